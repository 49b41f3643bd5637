"""A worker's threads while it trains, for the thread-discipline test: a few steps of an MLP whose
gradient buckets exceed ATen's parallel grain (32,768 elements, so a sum or copy of one opens an
intra-op team on the thread that runs it), exchanged through the shm allreduce overlapped with
backward on the communication thread (`overlap=True`: auto turns it off where the workers'
threads fill the cores); then, while that thread lives, the worker's OS threads
(/proc/self/task) and their names, written to DIR/rank<r>.json; then the same after two steps of
a replica with overlap=False, which starts no communication thread.

    phalanx run --devices cpu:2 --threads-per-device 3 thread_census.py DIR
"""

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

import phalanx


def threads() -> list[str]:
    names = []
    for tid in sorted(os.listdir("/proc/self/task")):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # a thread that ended meanwhile
            pass
    return names


def main() -> None:
    out = Path(sys.argv[1])
    world = phalanx.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    dp = phalanx.prepare(model, world=world, overlap=True)
    optimizer = torch.optim.SGD(dp.module.parameters(), lr=0.01)
    X, y = torch.randn(512, 256), torch.randint(0, 10, (512,))
    for _ in range(5):
        dp.zero_grad()
        phalanx.shard_loss(nn.functional.cross_entropy(dp(X), y, reduction="sum"), 512 * world.world_size).backward()
        dp.finish_gradient_sync()
        optimizer.step()
    record = {"rank": world.rank, "algorithm": dp.choices.algorithm, "intra_op_threads": torch.get_num_threads(),
              "threads": threads()}
    dp.close()
    # Without overlap the exchange runs on this thread: the replica's comm starts no thread at all.
    dp = phalanx.prepare(model, world=world, overlap=False)
    for _ in range(2):
        dp.zero_grad()
        phalanx.shard_loss(nn.functional.cross_entropy(dp(X), y, reduction="sum"), 512 * world.world_size).backward()
        dp.finish_gradient_sync()
    record["threads_without_overlap"] = threads()
    dp.close()
    (out / f"rank{world.rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
