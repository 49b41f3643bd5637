"""A map-style dataset that differs between ranks, or a sampler whose order does, stops the run
before its first step on 2 gloo workers: `phalanx.ShardedLoader` compares, once, every rank's
dataset length, a CRC of the first epoch's index order, one of its Subsets' indices and the
labels of the first global batch's first items, and every rank raises the same one-line
UsageError naming the cause and the fix. Before, a dataset cut by rank (Horovod's `Subset(full,
range(rank, n, k))`) trained on half the examples, and an unseeded numpy sampler gave each rank its
own order, both silently; so did, until 2026-12-07, a `random_split` of float targets drawn after a
per-rank seed (each rank trained on other examples). The whole dataset, a split drawn from one
generator and a sampler seeded through its generator are silent and train as before."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import Subset, TensorDataset, WeightedRandomSampler, random_split

import phalanx
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

N, BATCH = 96, 16


class _NumpyBalanced(torch.utils.data.Sampler):
    """A class-balanced order drawn from numpy's global RNG, as many CV repositories write it."""

    def __init__(self, labels: torch.Tensor) -> None:
        self.labels = labels.numpy()

    def __len__(self) -> int:
        return len(self.labels)

    def __iter__(self):
        classes = np.random.choice(np.unique(self.labels), len(self.labels))
        return iter([int(np.random.choice(np.where(self.labels == c)[0])) for c in classes])


def _first_epoch(world, dataset, **kwargs) -> str | None:
    """The UsageError's message when the loader refuses the data; None when it reads epoch 0."""
    loader = phalanx.ShardedLoader(dataset, world=world, global_batch_size=BATCH, seed=0, **kwargs)
    try:
        for _batch, _size in loader.epoch(0):
            pass
    except phalanx.UsageError as exc:
        return str(exc)
    return None


def _worker(world) -> dict:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(N, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (N,), generator=g)
    full = TensorDataset(x, y)
    rank, k = world.rank, world.world_size
    np.random.seed(100 + rank)  # an unseeded process's draws differ by rank
    weights = torch.ones(N, dtype=torch.float64)
    regression = TensorDataset(x, x.sum(dim=1))  # float targets: no label for the probe to compare
    torch.manual_seed(7 + rank)  # a per-rank seed (for augmentation), then the split drawn from it
    split_by_rank = random_split(regression, [80, 16])[0]
    split_by_rank_labels = random_split(full, [80, 16])[0]
    split_alike = random_split(regression, [80, 16], generator=torch.Generator().manual_seed(0))[0]
    return {
        "whole": _first_epoch(world, full),
        "cut by rank": _first_epoch(world, Subset(full, list(range(rank, N, k)))),
        "cut by rank, loader workers": _first_epoch(world, Subset(full, list(range(rank, N, k))), num_workers=2),
        "cut by rank, unevenly": _first_epoch(world, Subset(full, list(range(rank, N - 1, k)))),
        "numpy sampler": _first_epoch(world, full, sampler=_NumpyBalanced(y)),
        "seeded sampler": _first_epoch(world, full, sampler=WeightedRandomSampler(weights, N)),
        "random split by rank": _first_epoch(world, split_by_rank),
        "random split by rank, labels": _first_epoch(world, split_by_rank_labels),
        "random split alike": _first_epoch(world, split_alike),
    }


def test_data_that_differs_between_ranks_stops_the_run_in_one_line():
    results = run_workers(_worker, 2, timeout_s=90)
    assert results[0] == results[1]  # every rank raises the same error, at the same point
    said = results[0]
    assert said["whole"] is None and said["seeded sampler"] is None and said["random split alike"] is None, said
    subsets = "each rank passed a different dataset to ShardedLoader (rank 1's Subset holds other indices than rank 0's)"
    for case in ("cut by rank", "random split by rank", "random split by rank, labels"):
        assert said[case].startswith(subsets), (case, said[case])
        assert "random_split(data, lengths, generator=torch.Generator().manual_seed(0))" in said[case]
    assert said["cut by rank, unevenly"].startswith("each rank passed a different dataset to ShardedLoader "
                                                    "(rank 1's has 47 examples, rank 0's 48)"), said
    assert said["cut by rank, loader workers"] == said["cut by rank"]  # the items read in a worker
    assert "pass the whole dataset on every rank; ShardedLoader shards each global batch by rank itself" \
        in said["cut by rank, unevenly"]
    assert said["numpy sampler"].startswith("the sampler gives rank 1 another order than rank 0 in epoch 0"), said
    assert "draw from self.generator" in said["numpy sampler"]
    assert not any("\n" in message for message in said.values() if message)
