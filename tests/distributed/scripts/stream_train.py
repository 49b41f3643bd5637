"""A script training on a stream (an IterableDataset, split among its DataLoader workers by
get_worker_info and reshuffled by set_epoch with a fixed seed) through phalanx.ShardedLoader, then
evaluating a test stream with phalanx.evaluate_dataset; rank 0 saves the weights and the sums.

    python stream_train.py OUT [--workers N]          phalanx run --devices cpu:K stream_train.py OUT
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import phalanx


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        info = torch.utils.data.get_worker_info()
        mine = order if info is None else order[info.id::info.num_workers]
        g = torch.Generator().manual_seed(self.seed)
        X = torch.randn(self.n, 6, generator=g, dtype=torch.float64)
        y = (X[:, 0] > 0).long() + (X[:, 1] > 0).long()
        for i in mine.tolist():
            yield X[i], y[i]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--workers", type=int, default=0)
    args = p.parse_args()
    world = phalanx.init(device="cpu")
    torch.manual_seed(0)
    dp = phalanx.prepare(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)), world=world, dtype="float64")
    optimizer = torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9)
    loader = phalanx.ShardedLoader(Stream(53, seed=1), world=world, global_batch_size=16, num_workers=args.workers)
    steps = 0
    for epoch in range(2):
        for (X, y), global_size in loader.epoch(epoch):
            dp.zero_grad()
            phalanx.shard_loss(F.cross_entropy(dp(X), y, reduction="sum"), global_size).backward()
            dp.finish_gradient_sync()
            optimizer.step()
            steps += 1
    sums = phalanx.evaluate_dataset(dp, Stream(29, seed=2), world=world, batch_size=4)
    if world.is_main:
        torch.save({"model": dp.state_dict(), "sums": sums, "steps": steps}, args.out)
    dp.close()


if __name__ == "__main__":
    main()
