"""A training script written the way torchrun scripts are, for tests: it opens its own process
group (env://), reads LOCAL_RANK from the environment, shards with DistributedSampler, trains
through torch's DistributedDataParallel and saves rank 0's state dict, then destroys the group.
Nothing in it knows phalanx. It also records the launcher variables it was given.

    torchrun --nproc-per-node 2 torchrun_style.py --out DIR
    phalanx run --devices cpu:2 torchrun_style.py --out DIR
"""

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")


def regression_data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    X = torch.randn(n, 6, generator=g, dtype=torch.float64)
    y = torch.sin(X @ torch.linspace(-1, 1, 6, dtype=torch.float64)).unsqueeze(1)
    return TensorDataset(X, y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    initialised_before = dist.is_initialized()  # torchrun opens no group for the script; nor may phalanx
    dist.init_process_group("gloo")
    local_rank = int(os.environ["LOCAL_RANK"])
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    ddp = DistributedDataParallel(model)
    data = regression_data(120)
    sampler = DistributedSampler(data, shuffle=True, seed=3)
    loader = DataLoader(data, batch_size=10, sampler=sampler)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for X, y in loader:
            optimizer.zero_grad()
            nn.functional.mse_loss(ddp(X), y).backward()
            optimizer.step()
    out = Path(args.out)
    record = {"local_rank": local_rank, "initialised_before": initialised_before,
              "env": {name: os.environ.get(name) for name in LAUNCHER_VARS}}
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    if rank == 0:
        torch.save(model.state_dict(), out / "model.pt")
    print(f"rank {rank} of {dist.get_world_size()} done", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
