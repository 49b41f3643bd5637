"""The shm collectives as the algorithm registry calls them: allreduce, reduce-scatter and
all-gather through one `ShmGroup`'s rounds (shm.py), with per-rank `counts` for the two halves.

A tensor streams through in windows of a slot's worth of elements (`ShmGroup.windows`), one round
each; with uneven counts rank r's part of a window is its range [offset_r, offset_r + counts[r])
cut to the window, possibly empty. Rounds are numbered by the group, whichever collective runs
them, so one group serves all three in one call order; every rank makes the same calls with the
same numel, so every rank runs the same rounds. The counts are per member of the segment, in its
order (`ShmGroup.rank`): the world's ranks on one host, or one host's ranks in the hierarchical
collectives (hierarchical.py).

- Reduce-scatter, round g on half p = g % 2: each rank copies its window into its input slot
  (every range needs every rank's values) but for its own part, which no peer reads, publishes
  `arrived = g`, waits for all, then sums its own part from every slot, its own values read in
  place, in rank order 0..k-1 straight into its own tensor (the partial sums wait in its slot's
  unused part, so its own values are read before they are overwritten): one wait per round, as
  allreduce's small pieces (the sum compiled where the rounds are: one call, shm_kernel.c); a
  rank whose part is empty only copies in. Each range is summed once, by its owner, in a fixed
  order: deterministic, and the same bits as the small-piece allreduce gives that range.
  Skipping the own part is what makes it as cheap per byte as the allreduce: with two ranks it
  moves half the allreduce's bytes through memory.
- All-gather, round g on half p: each rank copies its part into half p's result area at its
  place in the window, publishes, waits for all, and copies the rest of the window out. With one
  owner this is a broadcast through memory: the owner copies in, every other rank copies out.
  Compiled, the round is one call (a copy, so any dtype).
- Every round of either writes the call's tag beside its flags before it publishes arrival and
  compares every rank's after the wait (shm_flags.TAGS); a call of one round whose tags agreed
  returns True, and settle (calls.py) skips the board's pairing check.
- Why half p may be written again in round g+2 (the allreduce's argument, unchanged): a rank
  begins round g+2 only after its wait in round g+1 saw every peer arrive there, and each peer
  publishes that arrival only after its reads of round g (the sums or the copy out) are done, in
  program order. Both collectives wait once in every round they run, so the argument covers any
  mix of the three collectives on one group.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple, Sequence

import torch

from phalanx.comm import shm_kernel
from phalanx.comm.counts import own_range
from phalanx.comm.shm import ShmGroup
from phalanx.comm.shm_sums import sum_into
from phalanx.comm.shm_flags import call_tags
from phalanx.runtime.board import Ticket
from phalanx.runtime.world import World


def allreduce_shm(flat: torch.Tensor, *, world: World, transport: ShmGroup | None = None,
                  ticket: Ticket | None = None, notes: torch.Tensor | None = None) -> bool:
    """Sum `flat` in place across `world` through `transport`'s shared segment (an ShmGroup);
    `ticket`: the call's entry on the collective board, when the caller made one. True when the
    segment itself saw every rank's call carry the ticket's tag (calls.py: settle skips the board's check).
    `notes`: the NaN/Inf check's two sums, taken as the data moves (ShmGroup.allreduce)."""
    return world.distributed and segment_of(transport, "allreduce").allreduce(flat, ticket=ticket, notes=notes)


def reduce_scatter_shm(flat: torch.Tensor, *, counts: Sequence[int], world: World, transport: ShmGroup | None = None,
                       ticket: Ticket | None = None) -> bool:
    """Sum over all ranks, into this rank's range of `flat` (counts[rank] elements after the
    counts before it), that range of every rank's `flat`; the rest of `flat` is left as it was.
    True when the call was one round and every rank's carried the ticket's tag (allreduce_shm's)."""
    agreed = []
    for r in _rounds("reduce-scatter", flat, counts, world, transport):
        tags = call_tags(ticket, r.g)
        done = _compiled_reduce_scatter_round(r, flat, tags, ticket)
        if done is None:  # the round in Python (shm_kernel.c does it in one call)
            mine = r.inputs[r.group.rank]
            _around_own(r, lambda a, b: mine[a - r.start:b - r.start].copy_(flat[a:b]))
            r.group.write_tags(r.g, tags)
            r.group.arrive(r.g, ticket)
            if r.hi > r.lo:
                own, part = flat[r.lo:r.hi], slice(r.lo - r.start, r.hi - r.start)
                parts = [own if index == r.group.rank else x[part] for index, x in enumerate(r.inputs)]
                sum_into(own, parts, scratch=mine[part])  # its own slot's part: copied in by none, read by none
            done = r.group.tags_agree(r.g, tags)
        agreed.append(done)
    return ticket is not None and agreed == [True]


def all_gather_shm(flat: torch.Tensor, *, counts: Sequence[int], world: World, transport: ShmGroup | None = None,
                   ticket: Ticket | None = None) -> bool:
    """Fill every rank's range of `flat` with that rank's piece (rank r's range: counts[r]
    elements after the counts before it), on every rank alike. True as reduce_scatter_shm's."""
    agreed = []
    for r in _rounds("all-gather", flat, counts, world, transport):
        tags = call_tags(ticket, r.g)
        done = _compiled_all_gather_round(r, flat, tags, ticket)
        if done is None:  # the round in Python
            if r.hi > r.lo:
                r.result[r.lo - r.start:r.hi - r.start].copy_(flat[r.lo:r.hi])
            r.group.write_tags(r.g, tags)
            r.group.arrive(r.g, ticket)
            _around_own(r, lambda a, b: flat[a:b].copy_(r.result[a - r.start:b - r.start]))
            done = r.group.tags_agree(r.g, tags)
        agreed.append(done)
    return ticket is not None and agreed == [True]


def _compiled_reduce_scatter_round(r: "_Round", flat: torch.Tensor, tags: tuple[int, int],
                                   ticket: Ticket | None) -> bool | None:
    """Round `r` of a reduce-scatter of `flat` in one compiled call, sleeping for a late peer as
    every wait does: whether every rank's tag agreed; None: the round runs in Python."""
    kernel = r.group.kernel_for(r.stop - r.start) if flat.dtype in shm_kernel.DTYPES and flat.is_contiguous() else None
    if kernel is None:
        return None

    def own_sum() -> None:
        if r.hi > r.lo:
            kernel.sum_with_own(flat[r.lo:r.hi], r.g % 2, offset_bytes=(r.lo - r.start) * flat.element_size())

    done = kernel.reduce_scatter_round(r.g % 2, r.g, flat, r.start, r.lo, r.hi, r.stop, *tags)
    return r.group.compiled_round_done(r.g, done, tags, ticket, rest=own_sum)


def _compiled_all_gather_round(r: "_Round", flat: torch.Tensor, tags: tuple[int, int],
                               ticket: Ticket | None) -> bool | None:
    """Round `r` of an all-gather of `flat` in one compiled call (a copy: any dtype), as above."""
    kernel = r.group.kernel_for(r.stop - r.start) if flat.is_contiguous() else None
    if kernel is None:
        return None
    done = kernel.all_gather_round(r.g % 2, r.g, flat, r.start, r.lo, r.hi, r.stop, *tags)
    return r.group.compiled_round_done(r.g, done, tags, ticket,
                                       rest=lambda: kernel.gather_out(r.g % 2, flat, r.start, r.lo, r.hi, r.stop))


def _around_own(r: "_Round", copy) -> None:
    """copy(a, b) for each non-empty [a, b) of the window outside this rank's part."""
    for a, b in ((r.start, r.lo), (r.hi, r.stop)) if r.hi > r.lo else ((r.start, r.stop),):
        if b > a:
            copy(a, b)


class _Round(NamedTuple):
    group: ShmGroup
    g: int  # the round's number
    inputs: list[torch.Tensor]  # its half's input slots and result area, a window's length each
    result: torch.Tensor
    start: int  # the window of flat: [start, stop)
    stop: int
    lo: int  # this rank's part of it: [lo, hi), none when hi <= lo
    hi: int


def _rounds(op: str, flat: torch.Tensor, counts: Sequence[int], world: World, transport) -> Iterator[_Round]:
    """The rounds `flat` streams through, each begun on the segment (none in a world of one)."""
    if not world.distributed:
        return
    group = segment_of(transport, op)
    lo, hi = own_range(counts, group.rank)
    for start, stop in group.windows(flat):
        g, inputs, result = group.begin(stop - start, flat.dtype)
        yield _Round(group, g, inputs, result, start, stop, max(lo, start), min(hi, stop))


def segment_of(transport, op: str) -> ShmGroup:
    """`transport` if it is the ShmGroup an shm collective needs; ValueError saying how to get one."""
    if not isinstance(transport, ShmGroup):
        raise ValueError(f"the shm {op} needs its shared segment: pass transport=phalanx.comm.ShmGroup(world=...) "
                         "or use phalanx.comm.AsyncComm(world=..., algorithms=('shm',))")
    return transport
