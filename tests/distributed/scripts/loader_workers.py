"""A user's script with DataLoader worker processes and no `if __name__ == "__main__":` guard,
for tests: it trains one small model per input pipeline (phalanx.ShardedLoader and a plain
DataLoader over a DistributedSampler; 0 or 2 loader workers, persistent or not) and saves each
rank's final parameters as `<pipeline>-rank<r>.pt`. Every process it starts records its pid in
`pids/`. `--fail` makes a loader worker of rank 1 raise, `--loader-exit` one call os._exit(3);
`--kill` has rank 1 SIGKILL itself at step 3, its 2 loader workers running (the first attempt
only: a restart runs to the end), `--exit` call os._exit(4) there instead. `--context spawn` (or
forkserver) starts the loader workers that way: from this unguarded top level, refused.

    phalanx run --devices cpu:2 loader_workers.py --out DIR
    torchrun --nproc-per-node 2 loader_workers.py --out DIR
"""
import argparse
import os
import signal
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import phalanx

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--fail", action="store_true", help="a loader worker of rank 1 raises")
parser.add_argument("--loader-exit", action="store_true", help="a loader worker of rank 1 calls os._exit(3)")
parser.add_argument("--kill", action="store_true", help="rank 1 SIGKILLs itself at step 3 of the first attempt")
parser.add_argument("--exit", action="store_true", help="rank 1 calls os._exit(4) at step 3 of the first attempt")
parser.add_argument("--context", help="the loader workers' multiprocessing_context: spawn, forkserver")
args = parser.parse_args()
out = Path(args.out)
(out / "pids").mkdir(parents=True, exist_ok=True)


def record_pid(*_) -> None:
    (out / "pids" / str(os.getpid())).touch()


class Waves(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.X = torch.randn(n, 6, generator=g, dtype=torch.float64)
        self.y = torch.sin(self.X.sum(1, keepdim=True))

    def __len__(self) -> int:
        return len(self.X)

    def __getitem__(self, i: int):
        if args.fail and world.rank == 1 and i == 7:
            raise RuntimeError("a loader worker of rank 1 found bad data")
        if args.loader_exit and world.rank == 1 and i == 7:
            os._exit(3)
        return self.X[i], self.y[i]


def batches(kind: str, epoch: int, loaders: dict, **kwargs):
    """(this rank's batch, global batch size) for every step of `epoch`."""
    if kind == "sharded":
        loader = loaders.setdefault(kind, phalanx.ShardedLoader(data, world=world, global_batch_size=20, seed=3,
                                                                **kwargs))
        yield from loader.epoch(epoch)
        return
    loader = loaders.setdefault(kind, DataLoader(data, batch_size=10, sampler=DistributedSampler(
        data, num_replicas=world.world_size, rank=world.rank, shuffle=True, seed=3), **kwargs))
    loader.sampler.set_epoch(epoch)
    for batch in loader:
        yield batch, 10 * world.world_size


world = phalanx.init()
record_pid()
data = Waves(120)
PIPELINES = [(kind, workers, persistent) for kind in ("sharded", "plain")
             for workers, persistent in ((0, False), (2, False), (2, True))]
kill = (args.kill or args.exit) and world.rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
one_pipeline = args.fail or args.loader_exit or args.kill or args.exit or args.context
for kind, workers, persistent in PIPELINES[2:3] if one_pipeline else PIPELINES:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    dp = phalanx.prepare(model, world=world)
    optimizer = torch.optim.SGD(dp.parameters(), lr=0.1)
    loaders: dict = {}
    for epoch in range(2):
        for step, ((X, y), global_size) in enumerate(batches(kind, epoch, loaders, num_workers=workers,
                                                             persistent_workers=persistent,
                                                             worker_init_fn=record_pid if workers else None,
                                                             multiprocessing_context=args.context)):
            if kill and step == 3:  # as the OOM killer does, its loader workers alive and holding its pipes
                os._exit(4) if args.exit else os.kill(os.getpid(), signal.SIGKILL)
            dp.zero_grad()
            loss = phalanx.shard_loss(((dp(X) - y) ** 2).sum(), global_size)
            loss.backward()
            dp.finish_gradient_sync()
            optimizer.step()
    name = f"{kind}-{workers}{'-persistent' if persistent else ''}"
    torch.save(dict(dp.module.state_dict()), out / f"{name}-rank{world.rank}.pt")
    dp.close()
