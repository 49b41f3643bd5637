"""Reduce-scatter and all-gather with per-rank counts: an allreduce's two halves as collectives of
their own, for sharded data parallelism (ZeRO stages 1-3: each rank keeps, sums and updates only
its range of one flat order of all parameters, counts.py).

    reduce_scatter(flat, *, counts, world, algorithm="native", transport=None, tag=...) -> view
        Rank r's range of `flat` (counts[r] elements after the counts before it) ends holding
        the sum of that range over all ranks, computed the same way every run; the rest of
        `flat` is unspecified. Returns the view of rank r's range.
    all_gather(flat, *, counts, world, algorithm="native", transport=None, tag=...) -> flat
        On entry rank r's range holds its piece; afterwards every rank's `flat` is all the
        pieces in rank order, bitwise identical everywhere. Returns `flat`.

`flat` is contiguous and 1-D, of the same dtype and numel on every rank, and the counts are the
same everywhere; AsyncComm launches the same calls without blocking (async_ops.py). A call is
entered on the collective board as what it is (the tag, marked with the kind of collective, so a
reduce-scatter never pairs with a peer's allreduce of one size), like every other collective.

The algorithms: `shm` (shm_ops.py), `hierarchical` (hierarchical.py: shm within each host, the
ring between hosts), `ring` (ring.py: the ring allreduce's two phases with the counts as its
chunks) and `native`, the backend's own:

- reduce-scatter: with NCCL, `dist.reduce_scatter` into this rank's range from the list of every
  rank's ranges (ProcessGroupNCCL runs equal sizes as one ncclReduceScatter and uneven ones as
  one ncclReduce per rank, in place for the root: NCCL allows it). With gloo, one allreduce of
  `flat` (the whole sum, this rank's range read from it; the rest of `flat` is unspecified by
  contract). gloo's reduce_scatter (torch 2.8, pytorch#149869; none before, so 2.4 failed) is
  one allreduce per rank: the same bytes in k calls, and measured 1.0-3.2x slower than the one
  allreduce here (2026-11-29, torch 2.13, k = 2 and 3, 4 KB-16 MB).
- all-gather: one `dist.broadcast` from each rank that owns elements, all in flight at once, so
  a bucket with one owner is a single broadcast. gloo's all_gather refuses uneven sizes, and
  padding every piece to the largest for `all_gather_single` moves k times a one-owner bucket;
  on gloo loopback (k = 2..4, 1-16 MB) the broadcasts took 1.3-15x less time than the padded
  gather, and 1.1-1.4x less even with equal counts. With NCCL and equal counts it is
  `all_gather_single` in place (NCCL's own ring, bandwidth-optimal; torch 2.4.1, 2.8.0 and the
  GPU machine's 2.11.0 know it only as `all_gather_into_tensor`, which 2.13 deprecates).
  NCCL paths: untested here (no GPU), written to the documented calls.

`tree` and `naive` have no reduce-scatter or all-gather: asking for one is a ValueError.
In a world of one both return at once (the counts are still checked).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from phalanx.comm.algorithms import ALGORITHMS, over_messages
from phalanx.comm.calls import run_collective
from phalanx.comm.counts import check_counts, own_range
from phalanx.comm.hierarchical import all_gather_hierarchical, reduce_scatter_hierarchical
from phalanx.comm.ring import all_gather_ring, reduce_scatter_ring
from phalanx.comm.shm_ops import all_gather_shm, reduce_scatter_shm
from phalanx.runtime.board import Ticket
from phalanx.runtime.tags import Tag
from phalanx.runtime.world import World

REDUCE_SCATTER, ALL_GATHER = "reduce-scatter", "all-gather"
REDUCE_SCATTER_TAG = Tag(REDUCE_SCATTER, op=REDUCE_SCATTER)  # a call that says nothing else of itself
ALL_GATHER_TAG = Tag(ALL_GATHER, op=ALL_GATHER)
SHARDED_ALGORITHMS = ("native", "shm", "hierarchical", "ring")
# torch's one-tensor all-gather: its current name where this torch has it, its older one else.
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# Every entry: fn(flat, *, counts, world, transport=None, ticket=None) -> True when its transport
# compared every rank's tag itself (shm's one-round calls), else None or False. Native is the
# backend's op, started by `_native_start`.
_FNS: dict[str, dict[str, Callable[..., None]]] = {
    REDUCE_SCATTER: {"shm": reduce_scatter_shm, "hierarchical": reduce_scatter_hierarchical,
                     "ring": over_messages(reduce_scatter_ring)},
    ALL_GATHER: {"shm": all_gather_shm, "hierarchical": all_gather_hierarchical,
                 "ring": over_messages(all_gather_ring)},
}


class Call(NamedTuple):
    """One prepared reduce-scatter or all-gather: what it returns, what it is entered as, and its
    work in both forms (`start()`: the native backend op; `job(transport, ticket)`: the others)."""

    result: torch.Tensor
    tag: Tag
    start: Callable[[], object]
    job: Callable[[object, Ticket | None], bool | None]  # True: the transport paired the call (calls.py)


def sharded_fn(op: str, algorithm: str) -> Callable[..., None] | None:
    """`op`'s function for `algorithm` (None for native, which runs as a backend op); ValueError
    for a name that is no algorithm or one without this collective."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown {op} algorithm {algorithm!r}; choose one of {', '.join(SHARDED_ALGORITHMS)}")
    if algorithm not in SHARDED_ALGORITHMS:
        raise ValueError(f"{op} has no {algorithm!r} algorithm; use {', '.join(SHARDED_ALGORITHMS)}")
    return _FNS[op].get(algorithm)


def prepare(op: str, flat: torch.Tensor, *, counts: Sequence[int], world: World, algorithm: str, tag: Tag) -> Call:
    """Check the call (algorithm, tensor, counts: ValueError with the numbers) and make its work."""
    fn = sharded_fn(op, algorithm)
    counts = check_counts(flat, counts, world.world_size, op=op)
    lo, hi = own_range(counts, world.rank)

    def job(transport, ticket: Ticket | None) -> bool | None:
        return fn(flat, counts=counts, world=world, transport=transport, ticket=ticket)

    return Call(flat[lo:hi] if op == REDUCE_SCATTER else flat, tag.doing(op), _native_start(op, flat, counts, world),
                job)


@torch.no_grad()
def reduce_scatter(flat: torch.Tensor, *, counts: Sequence[int], world: World, algorithm: str = "native",
                   transport=None, tag: Tag = REDUCE_SCATTER_TAG) -> torch.Tensor:
    """Sum every rank's `flat` into each rank's own range (`counts`: elements per rank, in rank
    order); return this rank's range, a view of `flat`. `transport`: an ShmGroup for shm; the
    default group otherwise. `tag`: what the call is, as a failure names it."""
    return _run(prepare(REDUCE_SCATTER, flat, counts=counts, world=world, algorithm=algorithm, tag=tag),
                world=world, algorithm=algorithm, transport=transport, flat=flat)


@torch.no_grad()
def all_gather(flat: torch.Tensor, *, counts: Sequence[int], world: World, algorithm: str = "native",
               transport=None, tag: Tag = ALL_GATHER_TAG) -> torch.Tensor:
    """Give every rank every rank's piece: rank r's range of `flat` (counts[r] elements) holds its
    own on entry, and every range holds its owner's on return, on every rank. Returns `flat`."""
    return _run(prepare(ALL_GATHER, flat, counts=counts, world=world, algorithm=algorithm, tag=tag),
                world=world, algorithm=algorithm, transport=transport, flat=flat)


def _run(call: Call, *, world: World, algorithm: str, transport, flat: torch.Tensor) -> torch.Tensor:
    if world.distributed:
        run_collective(world, algorithm, call.tag, flat, start=call.start, job=call.job, transport=transport)
    return call.result


def _native_start(op: str, flat: torch.Tensor, counts: tuple[int, ...], world: World) -> Callable[[], object]:
    """The backend's form of `op`, to be started on the default group (the module docstring says
    which calls and why)."""

    def start():
        lo, hi = own_range(counts, world.rank)
        if op == REDUCE_SCATTER and world.backend == "gloo":  # see the module docstring
            return dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True)  # the rest is unspecified
        if op == REDUCE_SCATTER:
            return dist.reduce_scatter(flat[lo:hi], list(flat.split(counts)), op=dist.ReduceOp.SUM, async_op=True)
        if world.backend == "nccl" and len(set(counts)) == 1:
            return _ALL_GATHER_SINGLE(flat, flat[lo:hi], async_op=True)
        return Works([dist.broadcast(piece, src=owner, async_op=True)
                      for owner, piece in enumerate(flat.split(counts)) if piece.numel()])

    return start


class Works:
    """Several backend works of one collective (an all-gather's broadcasts), waited as one: the
    part of a `Work` that calls.wait_work and AsyncComm use."""

    def __init__(self, works: list) -> None:
        self._works = works
        self._failed = False

    def wait(self, timeout=None) -> bool:
        for work in self._works:
            try:
                work.wait() if timeout is None else work.wait(timeout)
            except RuntimeError:
                self._failed = self._failed or work.is_completed()  # it failed, rather than timed out
                raise
        return True

    def is_completed(self) -> bool:
        return self._failed or all(work.is_completed() for work in self._works)

    def get_future(self) -> torch.futures.Future:
        return torch.futures.collect_all([work.get_future() for work in self._works])
