"""phalanx.comm without processes: chunking, the tree's schedule, name validation, size-1 no-ops,
and the hand-written algorithms run in threads over an in-memory transport for world sizes 1..9.
"""

from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from phalanx.comm import ALGORITHMS, AsyncComm, Handle, all_reduce_sum_, allreduce, allreduce_fn, broadcast_
from phalanx.comm.naive import allreduce_naive
from phalanx.comm.ring import allreduce_ring, chunk_sizes, segments
from phalanx.comm.tree import allreduce_tree, doubling_partners, fold_partner, largest_power_of_two
from phalanx.runtime.world import World
from tests.unit.even_split import assert_even_split

P2P_ALGORITHMS = {"ring": allreduce_ring, "tree": allreduce_tree, "naive": allreduce_naive}
SIZES = [0, 1, 2, 3, 7, 13, 100]


def make_world(rank: int, world_size: int) -> World:
    return World(
        rank=rank,
        world_size=world_size,
        local_rank=rank,
        local_world_size=world_size,
        device=torch.device("cpu"),
        backend="gloo" if world_size > 1 else "none",
        timeout_s=5.0,
    )


class Mailbox:
    """In-memory point-to-point network for k threads: one FIFO per (src, dst) pair.

    Sends are buffered (copied at send time), so only a schedule that receives a message nobody
    sends can block; that shows up as `queue.Empty` after the timeout instead of a hang.
    """

    def __init__(self, world_size: int) -> None:
        self.queues = {(s, d): queue.Queue() for s in range(world_size) for d in range(world_size)}
        self.sent_numel = [0] * world_size  # elements each rank sent, to check bandwidth claims
        self.steps = [0] * world_size  # exchanges each rank took part in

    def transport(self, rank: int) -> "FakeTransport":
        return FakeTransport(self, rank)


class FakeTransport:
    def __init__(self, mailbox: Mailbox, rank: int) -> None:
        self.mailbox, self.rank = mailbox, rank

    def exchange(self, *, sends=(), recvs=(), on_received=None) -> None:
        self.mailbox.steps[self.rank] += 1
        for peer, buf in [*sends, *recvs]:
            assert peer != self.rank, "message to self"
            assert buf.numel() > 0, "empty transfers must be skipped on both sides"
            assert buf.is_contiguous()
        for peer, buf in sends:
            self.mailbox.sent_numel[self.rank] += buf.numel()
            self.mailbox.queues[(self.rank, peer)].put(buf.clone())
        for index, (peer, buf) in enumerate(recvs):
            message = self.mailbox.queues[(peer, self.rank)].get(timeout=5)
            assert message.shape == buf.shape, f"rank {self.rank} got {message.shape} from {peer}, expected {buf.shape}"
            buf.copy_(message)
            if on_received is not None:
                on_received(index)


def simulate(fn, inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor], Mailbox]:
    """Run `fn` on every rank's copy of its input, one thread per rank; return the outputs."""
    k = len(inputs)
    mailbox = Mailbox(k)
    outputs = [x.clone() for x in inputs]
    with ThreadPoolExecutor(max_workers=k) as pool:
        futures = [
            pool.submit(fn, outputs[r], world=make_world(r, k), transport=mailbox.transport(r)) for r in range(k)
        ]
        for future in futures:
            future.result()
    for k_queue in mailbox.queues.values():
        assert k_queue.empty(), "a message was sent but never received"
    return outputs, mailbox


def rank_inputs(world_size: int, numel: int, dtype=torch.float64) -> list[torch.Tensor]:
    gens = [torch.Generator().manual_seed(1000 + r) for r in range(world_size)]
    return [torch.randn(numel, generator=g, dtype=torch.float64).to(dtype) for g in gens]


# --- chunking -------------------------------------------------------------------------------


@given(numel=st.integers(0, 10_000), parts=st.integers(1, 64))
def test_chunk_sizes_cover_and_balance(numel, parts):
    assert_even_split(chunk_sizes(numel, parts), numel, parts)  # larger first: chunk 0 sizes the ring's scratch


def test_chunk_sizes_small_tensor_leaves_empty_chunks():
    assert chunk_sizes(2, 4) == [1, 1, 0, 0]
    assert chunk_sizes(0, 3) == [0, 0, 0]
    assert chunk_sizes(10, 3) == [4, 3, 3]


@pytest.mark.parametrize("numel, parts", [(5, 0), (-1, 2)])
def test_chunk_sizes_rejects_bad_arguments(numel, parts):
    with pytest.raises(ValueError):
        chunk_sizes(numel, parts)


# --- the tree's schedule --------------------------------------------------------------------


@pytest.mark.parametrize("world_size", range(1, 10))
def test_tree_schedule_is_symmetric(world_size):
    p = largest_power_of_two(world_size)
    assert p <= world_size < 2 * p and p & (p - 1) == 0
    steps = p.bit_length() - 1
    for rank in range(world_size):
        partners = doubling_partners(rank, world_size)
        assert len(partners) == (steps if rank < p else 0)
        for step, peer in enumerate(partners):
            assert 0 <= peer < p
            assert doubling_partners(peer, world_size)[step] == rank  # both sides meet
        folded = fold_partner(rank, world_size)
        if folded is not None:
            assert fold_partner(folded, world_size) == rank
            assert (rank < p) != (folded < p)  # one inside the group, one extra
    extras = [r for r in range(world_size) if r >= p]
    assert sorted(fold_partner(r, world_size) for r in extras) == list(range(world_size - p))


def test_largest_power_of_two_rejects_empty_world():
    with pytest.raises(ValueError):
        largest_power_of_two(0)


# --- the algorithms, simulated in threads ---------------------------------------------------


@pytest.mark.parametrize("algorithm", sorted(P2P_ALGORITHMS))
@pytest.mark.parametrize("world_size", range(1, 10))
def test_simulated_allreduce_matches_sum_bitwise_identical(algorithm, world_size):
    for numel in SIZES:
        inputs = rank_inputs(world_size, numel)
        outputs, _ = simulate(P2P_ALGORITHMS[algorithm], inputs)
        expected = torch.stack(inputs).sum(0) if numel else torch.empty(0, dtype=torch.float64)
        for rank, out in enumerate(outputs):
            torch.testing.assert_close(out, expected, msg=lambda m: f"rank {rank}, numel {numel}: {m}")
            assert torch.equal(out, outputs[0]), f"rank {rank} differs from rank 0 (numel {numel})"


@pytest.mark.parametrize("world_size", range(1, 10))
def test_simulated_allreduce_exact_on_integers(world_size):
    inputs = [torch.arange(13, dtype=torch.int64) * (r + 1) for r in range(world_size)]
    expected = torch.arange(13, dtype=torch.int64) * (world_size * (world_size + 1) // 2)
    for fn in P2P_ALGORITHMS.values():
        outputs, _ = simulate(fn, inputs)
        for out in outputs:
            assert torch.equal(out, expected)


@pytest.mark.parametrize("world_size", [2, 3, 4, 7])
def test_ring_sends_2_k_minus_1_over_k_of_the_tensor(world_size):
    numel = 1000
    _, mailbox = simulate(allreduce_ring, rank_inputs(world_size, numel))
    largest_chunk = -(-numel // world_size)
    for rank in range(world_size):
        assert mailbox.steps[rank] == 2 * (world_size - 1)
        assert mailbox.sent_numel[rank] <= 2 * (world_size - 1) * largest_chunk
    assert sum(mailbox.sent_numel) == 2 * (world_size - 1) * numel  # each chunk goes k-1 hops, twice


@pytest.mark.parametrize("world_size, steps_in_group", [(2, 1), (4, 2), (8, 3), (5, 4), (7, 4)])
def test_tree_takes_log2_steps(world_size, steps_in_group):
    _, mailbox = simulate(allreduce_tree, rank_inputs(world_size, 10))
    # Rank 0 always has a group of p ranks; with extras it adds the fold-in and the send-back.
    assert mailbox.steps[0] == steps_in_group


# --- the public entry points ----------------------------------------------------------------


def test_algorithm_names_are_validated():
    assert set(ALGORITHMS) == {"native", "shm", "hierarchical", "ring", "tree", "naive"}
    for name in ALGORITHMS:
        assert callable(allreduce_fn(name))
    with pytest.raises(ValueError, match="native, shm, hierarchical, ring, tree, naive"):
        allreduce_fn("butterfly")
    with pytest.raises(ValueError, match="butterfly"):
        allreduce(torch.ones(2), world=make_world(0, 1), algorithm="butterfly")


def test_auto_picks_shm_on_one_host_hierarchical_on_hosts_of_several_workers_and_native_elsewhere():
    from dataclasses import replace

    from phalanx.comm import hierarchy_applies, resolve_algorithm, shm_applies
    from phalanx.runtime.segment import shm_supported

    local = make_world(0, 4)
    assert resolve_algorithm("auto", local) == ("shm" if shm_supported() is None else "native")
    assert shm_applies(local) == shm_supported()
    two_hosts = replace(local, local_rank=0, local_world_size=2)  # torchrun, 2 nodes x 2
    assert "span hosts" in shm_applies(two_hosts)
    assert resolve_algorithm("auto", two_hosts) == ("hierarchical" if shm_supported() is None else "native")
    assert hierarchy_applies(two_hosts) == shm_supported()
    one_each = replace(local, local_rank=0, local_world_size=1)  # 4 nodes x 1
    uneven = replace(make_world(0, 5), local_world_size=2)  # 5 ranks cannot be hosts of 2
    gpus = replace(local, device=torch.device("cuda", 0), backend="nccl")
    for world, why in ((one_each, "one worker"), (uneven, "do not divide"), (gpus, "serves CPU workers")):
        assert resolve_algorithm("auto", world) == "native"
        assert why in hierarchy_applies(world)
    assert "one host" in hierarchy_applies(local)
    assert resolve_algorithm("auto", make_world(0, 1)) == "native"  # nothing to exchange
    assert resolve_algorithm("ring", two_hosts) == "ring"  # a named algorithm is kept
    with pytest.raises(ValueError, match="choose one of auto, native, shm, hierarchical, ring, tree, naive"):
        resolve_algorithm("fastest", local)


def test_an_shm_allreduce_without_its_segment_says_how_to_get_one():
    with pytest.raises(ValueError, match="needs its shared segment"):
        allreduce(torch.ones(3), world=make_world(0, 2), algorithm="shm")
    with pytest.raises(ValueError, match="opened for native, not shm"):
        AsyncComm(world=make_world(0, 1), algorithms=("native",))._transport("shm")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_world_of_one_is_a_no_op(algorithm):
    assert not dist.is_initialized()  # nothing may need a process group
    world = make_world(0, 1)
    base = torch.arange(12.0).view(3, 4)
    tensor = base.t()  # non-contiguous
    before = tensor.clone()
    assert allreduce(tensor, world=world, algorithm=algorithm) is tensor
    assert torch.equal(tensor, before)
    flat = torch.arange(5.0)
    # The raw algorithm functions are no-ops on their own, too.
    allreduce_fn(algorithm)(flat, world=world)
    assert torch.equal(flat, torch.arange(5.0))
    assert broadcast_(tensor, world=world) is tensor
    assert all_reduce_sum_(tensor, world=world) is tensor
    assert torch.equal(tensor, before)


def test_broadcast_source_is_validated():
    with pytest.raises(ValueError, match="source rank 1"):
        broadcast_(torch.ones(2), world=make_world(0, 1), src=1)


def test_async_on_world_of_one_completes_at_once_and_waits_once():
    with AsyncComm(world=make_world(0, 1)) as comm:
        tensor = torch.arange(6.0).view(2, 3).t()
        handle = comm.allreduce_async(tensor, algorithm="ring")
        assert not handle.waited
        assert handle.wait() is tensor and torch.equal(tensor, torch.arange(6.0).view(2, 3).t())
        assert handle.wait() is tensor and handle.waited  # again, as torch's Work: returns at once
        with pytest.raises(ValueError, match="unknown allreduce algorithm"):
            comm.allreduce_async(tensor, algorithm="bogus")


def test_a_failed_handle_raises_its_error_again_on_a_second_wait():
    calls = []

    def fail() -> None:
        calls.append(1)
        raise RuntimeError("peer gone")

    handle = Handle(torch.zeros(3), None, fail)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="peer gone"):
            handle.wait()
    assert calls == [1]  # the collective's wait ran once


# --- the ring's segment pipeline ------------------------------------------------------------


@given(numel=st.integers(0, 5_000), segment_bytes=st.integers(1, 4_096),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_segments_tile_the_chunk_in_bounded_contiguous_views(numel, segment_bytes, dtype):
    chunk = torch.arange(numel).to(dtype)
    pieces = segments(chunk, segment_bytes)
    assert sum(p.numel() for p in pieces) == numel
    assert all(p.numel() > 0 and p.is_contiguous() for p in pieces)
    per_segment = max(1, segment_bytes // chunk.element_size())
    assert all(p.numel() <= per_segment for p in pieces)
    if pieces:  # views into the chunk, in order: writing a segment writes the chunk
        assert pieces[0].data_ptr() == chunk.data_ptr()
        assert max(p.numel() for p in pieces) - min(p.numel() for p in pieces) <= 1


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("numel", [1, 7, 97, 1000])
def test_ring_with_many_segments_equals_the_sum(world_size, numel):
    # 16-byte segments: every chunk travels as several messages, unevenly cut.
    def ring(flat, *, world, transport):
        allreduce_ring(flat, world=world, transport=transport, segment_bytes=16)

    inputs = rank_inputs(world_size, numel)
    outputs, mailbox = simulate(ring, inputs)
    expected = torch.stack(inputs).sum(dim=0)
    for out in outputs:
        torch.testing.assert_close(out, expected)
        assert torch.equal(out, outputs[0])  # bitwise identical on every rank
    assert mailbox.steps == [2 * (world_size - 1)] * world_size  # still one exchange per step


class _GlooWork:
    """A gloo Work as wait_work polls it: its timed waits time out `timeouts` times, then it is
    complete (wait() returns, or raises `failure`); `completes_at_last_timeout` makes it complete
    right after the last timed wait timed out, the race that once read as a 30 s stall."""

    def __init__(self, timeouts: int, *, failure: Exception | None = None) -> None:
        self.timeouts, self.failure, self.waits = timeouts, failure, 0

    def wait(self, timeout=None):
        self.waits += 1
        if timeout is not None and self.timeouts > 0:
            self.timeouts -= 1
            raise RuntimeError("Operation timed out!")
        if self.failure is not None:
            raise self.failure
        return True

    def is_completed(self) -> bool:
        return self.timeouts == 0


def test_a_gloo_collective_that_completes_as_a_poll_times_out_is_done_not_a_stall():
    from phalanx.comm.calls import wait_work

    world = World(rank=0, world_size=2, local_rank=0, local_world_size=2, device=torch.device("cpu"), backend="gloo",
                  timeout_s=30.0)
    work = _GlooWork(timeouts=3)  # complete as soon as its third timed wait has timed out
    wait_work(work, world=world, ticket=None)
    assert work.waits == 4
    failed = _GlooWork(timeouts=1, failure=RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):  # a real failure is still raised
        wait_work(failed, world=world, ticket=None)


def test_allreduce_refuses_auto_and_expanded_tensors_in_one_line():
    with pytest.raises(ValueError, match="phalanx.allreduce takes one algorithm, not 'auto'.*choose one of native"):
        allreduce(torch.ones(2), world=make_world(0, 1), algorithm="auto")
    with pytest.raises(ValueError, match=r"shape \(4,\) whose elements share memory \(stride 0, from expand\(\)\).*"
                                         "pass tensor.clone"):
        allreduce(torch.ones(1).expand(4), world=make_world(0, 1))
    allreduce(torch.ones(1).expand(1, 1), world=make_world(0, 1))  # a size-1 dimension's stride says nothing


def test_on_done_runs_for_a_completed_collective_only():
    # A trace drew a failed or never-run exchange as finished (tests/distributed/test_comm_cancelled.py).
    from concurrent.futures import Future

    from phalanx.comm.calls import when_completed

    done = []
    mark = when_completed(lambda: done.append(1))
    for outcome in ("result", "error", "cancel"):
        future = Future()
        if outcome == "result":
            future.set_result(True)
        elif outcome == "error":
            future.set_exception(RuntimeError("a peer stalled"))
        else:
            future.cancel()
        mark(future)
    native_ok, native_failed = torch.futures.Future(), torch.futures.Future()
    native_ok.set_result([torch.ones(1)])
    native_failed.set_exception(RuntimeError("gloo: connection reset"))
    mark(native_ok)
    mark(native_failed)
    assert done == [1, 1]  # the completed thread job and the completed backend work
