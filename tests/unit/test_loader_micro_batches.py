"""`ShardedLoader(micro_batches=n)` without processes: each step's n pieces, collated one by one,
are over all ranks one device's contiguous micro-batches of the same global batch (map-style and
streams), a rank's empty piece keeps the batch's structure, and bad values are one line. Training
with them against one device: tests/distributed/test_loader_micro_batches.py."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

import phalanx
from phalanx.data.split import rank_micro_batches, shard_sizes
from tests.unit.test_api import world


def _labels(piece) -> list[int]:
    return piece[1].tolist()


@pytest.mark.parametrize("k, micro_batches", [(2, 2), (3, 2), (3, 4)])
def test_each_steps_pieces_over_the_ranks_are_one_devices_contiguous_micro_batches(k, micro_batches):
    n, batch = 31, 10  # a last global batch of 1: one piece, on one rank
    data = TensorDataset(torch.arange(n, dtype=torch.float64).unsqueeze(1).repeat(1, 3), torch.arange(n))
    whole = list(phalanx.ShardedLoader(data, world=world(0, 1), global_batch_size=batch, seed=4).epoch(1))
    ranks = [list(phalanx.ShardedLoader(data, world=world(r, k), global_batch_size=batch, seed=4,
                                        micro_batches=micro_batches).epoch(1)) for r in range(k)]
    assert [[g for _, g in steps] for steps in ranks] == [[10, 10, 10, 1]] * k
    for step, ((X, y), global_size) in enumerate(whole):
        device_pieces = y.split(shard_sizes(global_size, min(micro_batches, global_size)))
        for r in range(k):
            assert isinstance(ranks[r][step][0], list) and len(ranks[r][step][0]) == len(device_pieces)
        for j, piece in enumerate(device_pieces):
            over_ranks = sum((_labels(ranks[r][step][0][j]) for r in range(k)), [])
            assert sorted(over_ranks) == sorted(piece.tolist())
            assert all(ranks[r][step][0][j][0].shape[1:] == (3,) for r in range(k))
    assert [len(_labels(ranks[r][-1][0][0])) for r in range(k)] == [1] + [0] * (k - 1)
    assert ranks[1][-1][0][0][0].dtype == torch.float64  # an empty piece keeps the batch's structure


def test_one_micro_batch_is_a_list_of_the_plain_loaders_batch():
    """A loop written for `micro_batches=args.accum` takes a list at 1 too; without the argument, the batch."""
    data = TensorDataset(torch.arange(12.0).unsqueeze(1), torch.arange(12))
    plain = list(phalanx.ShardedLoader(data, world=world(1, 2), global_batch_size=5).epoch(0))
    once = list(phalanx.ShardedLoader(data, world=world(1, 2), global_batch_size=5, micro_batches=1).epoch(0))
    assert all(isinstance(pieces, list) and len(pieces) == 1 for pieces, _ in once)
    assert [(_labels(b), g) for b, g in plain] == [(_labels(pieces[0]), g) for pieces, g in once]


class _Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield {"x": torch.full((2,), float(i)), "label": i}


@pytest.mark.parametrize("k", [2, 3])
def test_a_streams_pieces_over_the_ranks_are_one_devices_micro_batches(k):
    n, batch, micro_batches = 23, 8, 3
    ranks = [list(phalanx.ShardedLoader(_Stream(n), world=world(r, k), global_batch_size=batch,
                                        micro_batches=micro_batches).epoch(0)) for r in range(k)]
    assert [[g for _, g in steps] for steps in ranks] == [[8, 8, 7]] * k
    for step, size in enumerate([8, 8, 7]):
        first = step * batch
        ends = [first, *(first + s for s in torch.tensor(shard_sizes(size, micro_batches)).cumsum(0).tolist())]
        for j in range(micro_batches):
            over_ranks = sum((ranks[r][step][0][j]["label"].tolist() for r in range(k)), [])
            assert sorted(over_ranks) == list(range(ends[j], ends[j + 1]))
            assert all(ranks[r][step][0][j]["x"].shape[1:] == (2,) for r in range(k))


@pytest.mark.parametrize("value", [0, -1, 2.5, 9, True])
def test_micro_batches_outside_one_to_the_global_batch_is_one_line(value):
    data = TensorDataset(torch.zeros(20, 1))
    with pytest.raises(ValueError, match=rf"micro_batches={value} must be a whole number from 1 \(no accumulation\) to "
                                         r"global_batch_size \(8\)"):
        phalanx.ShardedLoader(data, world=world(0, 2), global_batch_size=8, micro_batches=value)


def test_phalanx_trains_cut_is_the_loaders_cut_a_tiny_batch_included():
    # One mechanism: phalanx train's rows and micro-batch counts (DataSplit) are the pieces ShardedLoader's
    # micro_batches yields. Before 2026-12-07 a batch of fewer examples than --grad-accum ran micro-batches
    # empty on every rank (under shard="parameters" each gathered every layer for nothing).
    from types import SimpleNamespace

    from phalanx.data_parallel.strategy import DataSplit

    for total, k, accum in itertools.product(range(1, 14), range(1, 5), range(1, 7)):
        for rank in range(k):
            split = DataSplit.__new__(DataSplit)
            split.dp, split.grad_accum_steps = SimpleNamespace(world=SimpleNamespace(world_size=k, rank=rank)), accum
            rows, counts = split._layout(total)
            pieces = rank_micro_batches(list(range(total)), rank=rank, world_size=k, micro_batches=accum)
            assert list(range(total))[rows] == sum(pieces, []) and counts == [len(p) for p in pieces]
            assert len(counts) == min(accum, total)
