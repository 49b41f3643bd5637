"""`phalanx.evaluate_dataset` shards one map-style dataset by rank itself, so a dataset each rank
already cut to its own part, or split at random per rank, evaluated other examples than one device
would, silently: each rank read its 1/k of its own part, and the count check passed (the parts
summed to one part's length). On 2 gloo workers the ranks now compare their datasets' length, the
labels of the first items and a CRC of their Subset indices first, and every rank raises the same
one-line UsageError naming the cause and the fix (before 2026-12-07: a result, wrong). The whole
dataset, and a split drawn from one generator, evaluate as one device does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, Subset, TensorDataset, random_split

import phalanx
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

N = 96


class _Strided(Dataset):
    """A rank's part of `data` as a dataset class of its own (no Subset): items rank, rank + k, ..."""

    def __init__(self, data, rank: int, world_size: int) -> None:
        self.data, self.rank, self.world_size = data, rank, world_size

    def __len__(self) -> int:
        return len(self.data) // self.world_size

    def __getitem__(self, i: int):
        return self.data[self.rank + i * self.world_size]


def _squared_error(model, batch):
    x, y = batch
    return {"squared_error": F.mse_loss(model(x).squeeze(1), y, reduction="sum")}


def _evaluated(world, model, dataset, **kwargs):
    """evaluate_dataset's dict, or its UsageError's message."""
    try:
        return phalanx.evaluate_dataset(model, dataset, world=world, batch_size=8, **kwargs)
    except phalanx.UsageError as exc:
        return str(exc)


def _worker(world) -> dict:
    g = torch.Generator().manual_seed(3)
    x, labels = torch.randn(N, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (N,), generator=g)
    regression, classes = TensorDataset(x, x.sum(dim=1)), TensorDataset(x, labels)
    torch.manual_seed(0)
    regressor, classifier = nn.Linear(6, 1).double(), nn.Linear(6, 3).double()
    rank, k = world.rank, world.world_size
    torch.manual_seed(7 + rank)  # a per-rank seed (for augmentation), then the split drawn from it
    split_by_rank = random_split(regression, [80, 16])[0]
    split_alike = random_split(regression, [80, 16], generator=torch.Generator().manual_seed(0))[0]
    with torch.no_grad():
        alone = {"whole": F.mse_loss(regressor(x).squeeze(1), x.sum(dim=1), reduction="sum").item(),
                 "split alike": sum(_squared_error(regressor, (x[i:i + 1], x[i:i + 1].sum(dim=1)))["squared_error"]
                                    .item() for i in split_alike.indices)}
    return {
        "alone": alone,
        "whole": _evaluated(world, regressor, regression, sums=_squared_error),
        "split alike": _evaluated(world, regressor, split_alike, sums=_squared_error),
        "random split by rank": _evaluated(world, regressor, split_by_rank, sums=_squared_error),
        "cut by rank": _evaluated(world, classifier, Subset(classes, list(range(rank, N, k)))),
        "cut by rank, unevenly": _evaluated(world, classifier, Subset(classes, list(range(rank, N - 1, k)))),
        "a class of its own by rank": _evaluated(world, classifier, _Strided(classes, rank, k)),
    }


def test_a_dataset_that_differs_between_ranks_is_refused_before_evaluating():
    results = run_workers(_worker, 2, timeout_s=90)
    said = results[0]
    assert {case: result for case, result in results[1].items() if case != "alone"} == \
        {case: result for case, result in said.items() if case != "alone"}  # the same result or error on every rank
    for case in ("whole", "split alike"):
        assert said[case]["count"] == (N if case == "whole" else 80)
        assert said[case]["squared_error"] == pytest.approx(said["alone"][case], rel=1e-12, abs=0)
    subsets = "each rank passed a different dataset to evaluate_dataset (rank 1's Subset holds other indices than " \
              "rank 0's)"
    for case in ("random split by rank", "cut by rank"):
        assert isinstance(said[case], str) and said[case].startswith(subsets), (case, said[case])
        assert "random_split(data, lengths, generator=torch.Generator().manual_seed(0))" in said[case]
        assert said[case].endswith("evaluate_dataset shards it by rank itself")
    assert said["cut by rank, unevenly"].startswith("each rank passed a different dataset to evaluate_dataset "
                                                    "(rank 1's has 47 examples, rank 0's 48): pass the whole dataset "
                                                    "on every rank; evaluate_dataset shards it by rank itself")
    assert said["a class of its own by rank"].startswith(
        "each rank passed a different dataset to evaluate_dataset (rank 1's holds other labels or keys than rank "
        "0's at the same indices)"), said
    assert not any("\n" in message for message in said.values() if isinstance(message, str))
