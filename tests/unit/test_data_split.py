"""Batch splitting, where data-parallel bugs hide: every example once per epoch, every rank the same cut."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.data import EpochBatches, global_batches, rank_shard, shard_bounds, shard_sizes, split_batch, steps_per_epoch
from phalanx.data.split import accumulation_rows, rank_micro_batches
from tests.unit.even_split import assert_even_split


@settings(max_examples=300, deadline=None)
@given(total=st.integers(0, 10_000), num_shards=st.integers(1, 64))
def test_shard_sizes_properties(total, num_shards):
    sizes = shard_sizes(total, num_shards)
    assert_even_split(sizes, total, num_shards)
    if total < num_shards:
        assert sizes == [1] * total + [0] * (num_shards - total)
    # bounds tile [0, total) in order, matching the sizes
    bounds = [shard_bounds(total, num_shards, i) for i in range(num_shards)]
    assert bounds[0][0] == 0 and bounds[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert [stop - start for start, stop in bounds] == sizes


def test_shard_sizes_examples():
    assert shard_sizes(10, 4) == [3, 3, 2, 2]
    assert shard_sizes(8, 4) == [2, 2, 2, 2]
    assert shard_sizes(2, 3) == [1, 1, 0]
    assert shard_sizes(0, 2) == [0, 0]
    assert shard_bounds(10, 4, 2) == (6, 8)


@pytest.mark.parametrize("total, num_shards", [(5, 0), (5, -1), (-1, 2)])
def test_shard_sizes_rejects(total, num_shards):
    with pytest.raises(ValueError):
        shard_sizes(total, num_shards)


@pytest.mark.parametrize("index", [-1, 4])
def test_shard_bounds_rejects_index(index):
    with pytest.raises(ValueError, match="outside 0..3"):
        shard_bounds(10, 4, index)


def test_split_batch_like_d2l():
    X = torch.arange(20.0).reshape(10, 2)
    y = torch.arange(10)
    parts = split_batch(X, y, 4)
    assert [p[0].shape[0] for p in parts] == [3, 3, 2, 2]
    torch.testing.assert_close(torch.cat([p[0] for p in parts]), X)
    torch.testing.assert_close(torch.cat([p[1] for p in parts]), y)
    for Xi, yi in parts:  # pairs stay aligned
        torch.testing.assert_close(Xi[:, 0] / 2, yi.float())


def test_split_batch_fewer_examples_than_shards():
    parts = split_batch(torch.ones(2, 3), torch.zeros(2), 4)
    assert [p[0].shape for p in parts] == [(1, 3), (1, 3), (0, 3), (0, 3)]


def test_split_batch_length_mismatch():
    with pytest.raises(ValueError, match="X has 4 examples but y has 3"):
        split_batch(torch.ones(4, 2), torch.ones(3), 2)


@pytest.mark.parametrize("n, batch", [(0, 4), (1, 4), (10, 3), (12, 4), (1000, 256), (5, 100)])
def test_global_batches_cover_every_index_once(n, batch):
    for epoch in range(3):
        batches = global_batches(n, batch, seed=7, epoch=epoch)
        assert len(batches) == steps_per_epoch(n, batch)
        assert all(b.dtype == torch.int64 and b.dim() == 1 for b in batches)
        assert all(b.numel() == batch for b in batches[:-1])  # only the last may be short
        flat = torch.cat(batches) if batches else torch.empty(0, dtype=torch.int64)
        assert sorted(flat.tolist()) == list(range(n))


def test_global_batches_same_across_calls_and_differ_across_epochs():
    a = global_batches(1000, 64, seed=3, epoch=5)
    b = global_batches(1000, 64, seed=3, epoch=5)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    order = {e: torch.cat(global_batches(1000, 64, seed=3, epoch=e)) for e in range(4)}
    assert len({tuple(v.tolist()) for v in order.values()}) == 4
    assert not torch.equal(torch.cat(global_batches(1000, 64, seed=4, epoch=5)), torch.cat(a))


def test_global_batches_ignore_global_rng():
    # Ranks may have consumed the global RNG differently (dropout, init); the order must not care.
    torch.manual_seed(0)
    a = torch.cat(global_batches(100, 10, seed=1, epoch=0))
    torch.rand(17)
    b = torch.cat(global_batches(100, 10, seed=1, epoch=0))
    assert torch.equal(a, b)


def test_global_batches_no_shuffle():
    assert torch.equal(torch.cat(global_batches(10, 4, seed=0, epoch=3, shuffle=False)), torch.arange(10))


def test_steps_per_epoch():
    assert steps_per_epoch(60000, 256) == 235
    assert steps_per_epoch(256, 256) == 1
    assert steps_per_epoch(0, 256) == 0
    with pytest.raises(ValueError, match="global_batch_size must be >= 1, got 0"):
        steps_per_epoch(10, 0)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 300), batch=st.integers(1, 70), world_size=st.integers(1, 8), epoch=st.integers(0, 5))
def test_rank_shards_reassemble_the_global_batch(n, batch, world_size, epoch):
    for global_batch in global_batches(n, batch, seed=11, epoch=epoch):
        shards = [rank_shard(global_batch, rank=r, world_size=world_size) for r in range(world_size)]
        assert torch.equal(torch.cat(shards), global_batch)
        # rank_shard and split_batch make the same cut
        split = split_batch(global_batch, global_batch, world_size)
        assert all(torch.equal(s, p[0]) for s, p in zip(shards, split))


def test_rank_shard_rejects():
    with pytest.raises(ValueError, match="outside"):
        rank_shard(torch.arange(4), rank=2, world_size=2)
    with pytest.raises(ValueError, match=r"^rank_shard: a 0-dim tensor has no rows to share"):
        rank_shard(torch.tensor(3), rank=0, world_size=1)
    with pytest.raises(TypeError, match=r"got dict: cut each value, \{key: rank_shard\(value, world=world\) for "):
        rank_shard({"a": [1, 2]}, rank=0, world_size=1)
    for items, given in ((iter([1, 2]), "list_iterator"), ("abcd", "str")):
        with pytest.raises(TypeError, match=rf"^rank_shard takes a tensor \(its rows\) or a sequence .*, got {given}: "
                                            r"pass list\(items\)$"):
            rank_shard(items, rank=0, world_size=1)


@dataclass
class _Ranked:
    rank: int
    world_size: int


def test_rank_shard_cuts_a_tensor_s_rows_or_a_sequence_for_world_or_rank():
    # Accelerate's split_between_processes(items) ported as rank_shard(items, world=world): before
    # 2026-12-06 only a 1-D index tensor with rank= and world_size= (world= was Python's bare "unexpected
    # keyword", a list an AttributeError, a batch of rows a ValueError).
    rows = torch.arange(30.0).reshape(10, 3)
    for world_size in (1, 2, 3, 4):
        shares = [rank_shard(rows, world=_Ranked(rank, world_size)) for rank in range(world_size)]
        assert torch.equal(torch.cat(shares), rows)
        assert [len(share) for share in shares] == shard_sizes(10, world_size)
        storage = rows.untyped_storage().data_ptr()
        assert all(share.untyped_storage().data_ptr() == storage for share in shares)  # views
        for rank in range(world_size):
            assert torch.equal(rank_shard(rows, rank=rank, world_size=world_size), shares[rank])
            names, cut = ["a", "b", "c", "d", "e"], slice(*shard_bounds(5, world_size, rank))
            mine = rank_shard(names, world=_Ranked(rank, world_size))
            assert mine == names[cut] and isinstance(mine, list)
            assert rank_shard(range(5), world=_Ranked(rank, world_size)) == range(5)[cut]
            assert rank_shard(tuple(names), rank=rank, world_size=world_size) == tuple(mine)
            array = rows.numpy()  # numpy's rows too, as a view
            share = rank_shard(array, world=_Ranked(rank, world_size))
            assert np.array_equal(share, shares[rank].numpy()) and np.shares_memory(share, array)
    with pytest.raises(TypeError, match=r"^rank_shard takes world= or rank= and world_size=, not both"):
        rank_shard(rows, world=_Ranked(0, 2), rank=0, world_size=2)
    for partial in ({}, {"rank": 0}, {"world_size": 2}):
        with pytest.raises(TypeError, match=r"^rank_shard needs whose share it is: rank_shard\(items, world=world\)"):
            rank_shard(rows, **partial)


def test_epoch_batches_matches_function():
    schedule = EpochBatches(num_examples=50, global_batch_size=16, seed=2)
    assert schedule.steps_per_epoch == 4
    assert all(torch.equal(a, b) for a, b in zip(schedule.epoch(1), global_batches(50, 16, seed=2, epoch=1)))
    with pytest.raises(ValueError, match="got 0"):
        EpochBatches(num_examples=50, global_batch_size=0, seed=2)


@settings(max_examples=300, deadline=None)
@given(total=st.integers(0, 500), world_size=st.integers(1, 8), micro_batches=st.integers(1, 6))
def test_accumulation_rows_give_every_micro_batch_of_one_device_and_even_shares(total, world_size, micro_batches):
    """Micro-batch j over all ranks is 1 device's contiguous micro-batch j (what a synchronized
    BatchNorm normalizes over), each rank holds floor or ceil of every micro-batch over k, and its
    shard is as large as its contiguous one: together every row once."""
    ends = np.cumsum([0, *shard_sizes(total, micro_batches)])
    over_ranks = [[] for _ in range(micro_batches)]
    for rank in range(world_size):
        rows, counts = accumulation_rows(total, world_size, rank, micro_batches)
        mine = list(range(total))[rows]
        assert len(mine) == sum(counts) == shard_sizes(total, world_size)[rank]
        if micro_batches == 1:
            assert (rows.start, rows.stop) == shard_bounds(total, world_size, rank)
        cut = np.cumsum([0, *counts])
        for j in range(micro_batches):
            piece = mine[cut[j]:cut[j + 1]]
            assert all(ends[j] <= p < ends[j + 1] for p in piece)
            assert len(piece) in (len(range(ends[j], ends[j + 1])) // world_size,
                                  -(-len(range(ends[j], ends[j + 1])) // world_size))
            over_ranks[j] += piece
    assert [sorted(rows) for rows in over_ranks] == [list(range(ends[j], ends[j + 1])) for j in range(micro_batches)]


@settings(max_examples=300, deadline=None)
@given(total=st.integers(1, 300), world_size=st.integers(1, 8), micro_batches=st.integers(1, 6))
def test_rank_micro_batches_over_the_ranks_are_one_devices_micro_batches(total, world_size, micro_batches):
    """Piece j over all ranks is 1 device's contiguous micro-batch j, with min(n, total) pieces, so
    none is empty on every rank; a list and a tensor are cut alike; one piece is the contiguous shard."""
    items = list(range(100, 100 + total))
    pieces = [rank_micro_batches(items, rank=r, world_size=world_size, micro_batches=micro_batches)
              for r in range(world_size)]
    device = rank_micro_batches(items, rank=0, world_size=1, micro_batches=micro_batches)
    assert len(device) == min(micro_batches, total) and all(device)
    assert [len(p) for p in device] == shard_sizes(total, len(device))
    assert sum(device, []) == items  # one device's pieces are contiguous, in order
    for j, piece in enumerate(device):
        assert sorted(sum((mine[j] for mine in pieces), [])) == piece
    as_tensor = rank_micro_batches(torch.tensor(items), rank=world_size - 1, world_size=world_size,
                                   micro_batches=micro_batches)
    assert [p.tolist() for p in as_tensor] == pieces[-1]
    if micro_batches == 1:
        assert all(mine == [rank_shard(items, rank=r, world_size=world_size)] for r, mine in enumerate(pieces))
