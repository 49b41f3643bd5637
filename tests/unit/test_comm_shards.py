"""Reduce-scatter and all-gather without processes: the counts' checks, the refusals, a world of
one, and the ring's chunk bookkeeping run in threads over the in-memory transport of test_comm.py
(the board telling a reduce-scatter from an allreduce: test_board.py)."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.comm import AsyncComm, all_gather, reduce_scatter
from phalanx.comm.counts import check_counts, own_range
from phalanx.comm.ring import all_gather_ring, reduce_scatter_ring
from phalanx.comm.shards import sharded_fn
from phalanx.comm.shm import sum_into
from tests.unit.test_comm import make_world, simulate


def counts_like(world_size: int, numel: int, pattern: str) -> list[int]:
    """Per-rank counts summing to numel: even, uneven with zeros, or one owner of everything."""
    if pattern == "even":
        return [numel // world_size + (r < numel % world_size) for r in range(world_size)]
    if pattern == "owner":
        return [numel if r == world_size // 2 else 0 for r in range(world_size)]
    weights = [(3 * r + 1) % 4 for r in range(world_size)]  # 1, 0, 3, 2, 1, 0, ...: some ranks own nothing
    counts = [numel * w // max(1, sum(weights)) for w in weights]
    counts[weights.index(max(weights))] += numel - sum(counts)
    return counts


# --- the counts ---------------------------------------------------------------------------


@pytest.mark.parametrize("counts, words", [
    ([4, 4, 4], "have 3 entries for 2 ranks; pass one count per rank"),
    ([9, -1], "include a negative count"),
    ([3, 4], "sum to 7, but the tensor has 8 elements"),
])
def test_counts_that_do_not_cut_the_tensor_are_refused_with_the_numbers(counts, words):
    with pytest.raises(ValueError, match=words):
        check_counts(torch.zeros(8), counts, 2, op="reduce-scatter")


def test_counts_need_a_flat_contiguous_tensor_and_become_a_tuple():
    with pytest.raises(ValueError, match=r"all-gather needs a contiguous 1-D tensor, got shape \(2, 4\)"):
        check_counts(torch.zeros(2, 4), [4, 4], 2, op="all-gather")
    with pytest.raises(ValueError, match="contiguous 1-D"):
        check_counts(torch.zeros(16)[::2], [4, 4], 2, op="all-gather")
    assert check_counts(torch.zeros(8), (torch.tensor(3).item(), 5), 2, op="x") == (3, 5)
    assert [own_range([3, 0, 5], r) for r in range(3)] == [(0, 3), (3, 3), (3, 8)]


def test_tree_and_naive_are_refused_and_unknown_names_listed():
    for algorithm in ("tree", "naive"):
        with pytest.raises(ValueError, match=f"reduce-scatter has no '{algorithm}' algorithm; use native, shm, hierarchical, ring"):
            sharded_fn("reduce-scatter", algorithm)
    with pytest.raises(ValueError, match="unknown all-gather algorithm 'butterfly'; choose one of native, shm, hierarchical, ring"):
        all_gather(torch.zeros(2), counts=[2], world=make_world(0, 1), algorithm="butterfly")
    assert sharded_fn("all-gather", "native") is None


def test_world_of_one_returns_at_once_and_still_checks_counts():
    world, flat = make_world(0, 1), torch.arange(5.0)
    assert reduce_scatter(flat, counts=[5], world=world).data_ptr() == flat.data_ptr()
    assert all_gather(flat, counts=(5,), world=world, algorithm="ring") is flat
    with pytest.raises(ValueError, match="sum to 4"):
        reduce_scatter(flat, counts=[4], world=world)
    done = []
    with AsyncComm(world=world) as comm:
        handle = comm.reduce_scatter_async(flat, counts=[5], on_done=lambda: done.append(1))
        assert torch.equal(handle.wait(), flat) and done == [1]
        assert comm.all_gather_async(flat, counts=[5]).wait() is flat
        assert comm.all_gather(flat, counts=[5], algorithm="ring") is flat
        assert torch.equal(comm.reduce_scatter(flat, counts=[5]), torch.arange(5.0))
    assert torch.equal(flat, torch.arange(5.0))


@pytest.mark.parametrize("k", [2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shm_sum_reads_a_part_that_is_its_output_before_writing_it(k, dtype):
    parts = [torch.randn(33, generator=torch.Generator().manual_seed(r)).to(dtype) for r in range(k)]
    ordered = parts[0] + parts[1]
    for part in parts[2:]:
        ordered = ordered + part
    for own in range(k):  # a reduce-scatter's own values are its output
        out = parts[own].clone()
        sum_into(out, [out if r == own else part for r, part in enumerate(parts)], scratch=torch.empty(33, dtype=dtype))
        assert torch.equal(out, ordered), own


# --- the ring's bookkeeping, in threads ---------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(world_size=st.integers(1, 6), numel=st.integers(0, 40), pattern=st.sampled_from(["even", "uneven", "owner"]),
       segment_bytes=st.sampled_from([8, 24, 1 << 20]))
def test_ring_reduce_scatter_leaves_each_rank_its_own_sum(world_size, numel, pattern, segment_bytes):
    counts = counts_like(world_size, numel, pattern)
    inputs = [torch.arange(numel, dtype=torch.float64) * (r + 1) + r for r in range(world_size)]  # sums exact
    fn = functools.partial(reduce_scatter_ring, counts=counts, segment_bytes=segment_bytes)
    outputs, mailbox = simulate(fn, inputs)
    total = torch.stack(inputs).sum(0)
    for rank, out in enumerate(outputs):
        lo, hi = own_range(counts, rank)
        assert torch.equal(out[lo:hi], total[lo:hi]), (rank, counts)
        if world_size > 1:  # every chunk but its own leaves a rank once; an empty one never does
            assert mailbox.sent_numel[rank] == numel - counts[rank]


@settings(max_examples=40, deadline=None)
@given(world_size=st.integers(1, 6), numel=st.integers(0, 40), pattern=st.sampled_from(["even", "uneven", "owner"]),
       segment_bytes=st.sampled_from([8, 1 << 20]))
def test_ring_all_gather_gives_every_rank_every_piece(world_size, numel, pattern, segment_bytes):
    counts = counts_like(world_size, numel, pattern)
    expected = torch.randn(numel, dtype=torch.float64)
    inputs = []
    for rank in range(world_size):
        lo, hi = own_range(counts, rank)
        mine = torch.full((numel,), float("nan"), dtype=torch.float64)  # whatever is outside its range is overwritten
        mine[lo:hi] = expected[lo:hi]
        inputs.append(mine)
    fn = functools.partial(all_gather_ring, counts=counts, segment_bytes=segment_bytes)
    outputs, mailbox = simulate(fn, inputs)
    for rank, out in enumerate(outputs):
        assert torch.equal(out, expected), (rank, counts)
        if world_size > 1:  # every chunk but the right neighbour's passes through a rank once
            assert mailbox.sent_numel[rank] == numel - counts[(rank + 1) % world_size]
