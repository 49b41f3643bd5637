"""A user's training script with a BatchNorm model, written with phalanx's API the way a DDP user
writes a loop (the replica used as the model, `torch.save(dp.state_dict())`), for
tests/distributed/test_batchnorm_run_script.py and test_two_nodes.py:

    phalanx run --devices cpu:2 tests/distributed/ddp_habits_script.py --out DIR
    torchrun --nnodes 2 --node-rank R ... tests/distributed/ddp_habits_script.py --out DIR

The default is phalanx's way: `phalanx.prepare` (SyncBatchNorm on k > 1 devices), ShardedLoader,
`shard_loss`, `reduce` for the logged loss, MetricsLogger and progress. Three flags switch on
DDP's habits instead: `--plain` (a DataParallel built directly: plain BatchNorm), `--mean-loss`
(F.cross_entropy's mean), `--distributed-sampler` (torch's, with set_epoch); `--two-heads` gives
the model a second head used on odd steps only, so every other step leaves parameters out. Writes
`DIR/rank<r>.pt` (every rank's state_dict) and, on rank 0, `DIR/metrics.jsonl`.
"""

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import phalanx


def blobs(n: int, *, seed: int) -> TensorDataset:
    """`n` points of 3 classes in 6 dimensions, shifted and scaled so BatchNorm has work to do."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    X = torch.randn(n, 6, generator=g, dtype=torch.float64) * 3 + 5 + y.unsqueeze(1).double()
    return TensorDataset(X, y)


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


class TwoHeads(nn.Module):
    """model()'s layers with a second head, which the loop uses on every other step only."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.heads = nn.ModuleList([nn.Linear(16, 3), nn.Linear(16, 3)])

    def forward(self, x: torch.Tensor, head: int = 0) -> torch.Tensor:
        return self.heads[head](self.trunk(x))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--examples", type=int, default=303)
    p.add_argument("--batch-size", type=int, default=40, help="the global batch")
    p.add_argument("--out", required=True)
    p.add_argument("--plain", action="store_true", help="phalanx.DataParallel(model) instead of phalanx.prepare")
    p.add_argument("--mean-loss", action="store_true", help="F.cross_entropy's mean instead of shard_loss")
    p.add_argument("--distributed-sampler", action="store_true", help="torch's DistributedSampler")
    p.add_argument("--two-heads", action="store_true", help="a second head, used on odd steps only (unused on even)")
    args = p.parse_args()

    world = phalanx.init()
    torch.manual_seed(0)
    net = TwoHeads() if args.two_heads else model()
    if args.plain:
        dp = phalanx.DataParallel(net.double(), world=world)
    else:
        dp = phalanx.prepare(net, world=world, dtype="float64")
        world.print(f"replica: {dp.choices.describe()}")
    optimizer = torch.optim.SGD(dp.parameters(), lr=0.05, momentum=0.9)
    train, test = blobs(args.examples, seed=1), blobs(101, seed=2)
    if args.distributed_sampler:
        sampler = DistributedSampler(train, num_replicas=world.world_size, rank=world.rank, seed=0)
        loader = DataLoader(train, batch_size=args.batch_size // world.world_size, sampler=sampler)
    else:
        sharded = phalanx.ShardedLoader(train, world=world, global_batch_size=args.batch_size, seed=0)
    with phalanx.MetricsLogger(args.out, world=world) as log:
        for epoch in range(args.epochs):
            if args.distributed_sampler:
                sampler.set_epoch(epoch)
                steps = ((batch, args.batch_size) for batch in loader)
            else:
                steps = sharded.epoch(epoch)
            loss_total = torch.zeros((), dtype=torch.float64)
            dp.train()
            for step, ((X, y), global_size) in enumerate(phalanx.progress(
                    steps, world=world, label=f"epoch {epoch + 1}",
                    total=len(loader) if args.distributed_sampler else len(sharded))):
                dp.zero_grad()
                out = dp(X.to(world.device), head=step % 2) if args.two_heads else dp(X.to(world.device))
                y = y.to(world.device)
                loss = F.cross_entropy(out, y) if args.mean_loss else phalanx.shard_loss(
                    F.cross_entropy(out, y, reduction="sum"), global_size)
                loss.backward()
                dp.finish_gradient_sync()
                optimizer.step()
                loss_total += loss.detach()
            sums = phalanx.evaluate_dataset(dp, test, world=world)
            row = {"epoch": epoch + 1, "train_loss_sum": phalanx.reduce(loss_total, op="sum", world=world),
                   "test_loss": sums["loss"] / sums["count"], "test_acc": sums["correct"] / sums["count"]}
            log.log(row)
            world.print(f"epoch {epoch + 1}  test loss {row['test_loss']:.4f}  test acc {row['test_acc']:.3f}")
    os.makedirs(args.out, exist_ok=True)
    torch.save(dp.state_dict(), os.path.join(args.out, f"rank{world.rank}.pt"))  # DDP's habit, no .module
    dp.close()


if __name__ == "__main__":
    main()
