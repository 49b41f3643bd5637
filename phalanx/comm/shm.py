"""Collectives through shared memory for the workers of one host: the chapter's "more efficient
allreduce" where every rank can read every other rank's memory.

gloo has no shared-memory path (pytorch/gloo#455): on one host each call still goes through
loopback TCP and pays ~0.3-1.3 ms however small (docs/benchmarks.md), while an MPI or DeepSpeed
shared-memory allreduce on the same host costs tens of microseconds (deepspeedai/DeepSpeed#5391).
`ShmGroup` maps one segment into every local rank and sums through it:

- Round g (a tensor larger than a slot streams through as several rounds) uses buffer half
  p = g % 2. Every rank copies its piece into its input slot of half p and publishes
  `arrived = g` in its own cache line of flags.
- Small pieces (every piece, with two ranks): once every rank has arrived, each rank sums all
  input slots in rank order 0..k-1 straight into its own tensor (one wait per round).
- Large pieces: rank j sums chunk j of every input slot, in rank order, into half p's result
  area and publishes `reduced = g`; once every rank has, each copies the whole result out. Each
  chunk is summed once, so every rank ends bitwise identical; the fixed order makes it
  deterministic run to run.
- No barrier frees a buffer: half p is written again only in round g+2, and a rank reaches that
  only after seeing every peer arrive in round g+1, which each did only after it finished
  reading round g. So round g+1 can start while a slow peer still copies round g out.
- Reduce-scatter and all-gather run on the same rounds, counted by the same group in call order
  (shm_ops.py: how each uses a round, and why the argument above still holds for them).

Waiting (shm_flags.py) spins briefly, then sleeps on the flag's futex, which the publishing rank
wakes: a waiter costs no CPU, so k workers on fewer cores (or a comm thread beside backward) do
not starve each other. Sleeps are bounded: after each, a peer that died is named, and the
watchdog reads the collective board (watchdog.py), so a peer that never arrives ends the wait
within the timeout, named with what its process is doing; `abort()` ends a wait.

Rounds run compiled where the host has a C compiler (shm_kernel.c: a whole small round in one
call, the GIL released; the spins, publishes and chunk sums of large ones) and in Python
otherwise, to the same bits: both add in rank order in the element's type (a large round on a
thread with an intra-op team runs on torch's ops, which split it over that team: TEAM_NUMEL). The
first line of a run says when rounds run in Python, and why.

The ranks open the segment together (`share_segment`): in /dev/shm, mode 0600, named for the
run, unlinked once every rank has mapped it, so nothing is left on disk however a process ends
(the launcher removes one a worker killed in that window leaves). Correctness relies on one
rank's stores becoming visible to others in program order (x86-64's TSO memory model);
`shm_supported()` says no elsewhere, and `auto` then picks the backend's own collective.
"""

from __future__ import annotations

import mmap
import os
from typing import Callable

import torch
import torch.distributed as dist

from phalanx.comm import shm_kernel
from phalanx.comm.calls import collective
from phalanx.comm.shm_flags import (ARRIVED, LINE, LIVENESS_EVERY_S, REDUCED, SPIN_S, Flags, ShmError, ShmPeerGone,
                                   call_tags)
from phalanx.comm.shm_sums import chunk_of, sum_into
from phalanx.runtime.binding import available_cores
from phalanx.runtime.board import Ticket
from phalanx.runtime.tags import Tag
from phalanx.runtime.segment import (NAME_PREFIX, SHM_DIR, create_segment, free_bytes, remove_segments_of,
                                     share_segment, shm_applies, shm_supported)
from phalanx.runtime.world import World

__all__ = ["LIVENESS_EVERY_S", "NAME_PREFIX", "SHM_DIR", "ShmError", "ShmGroup", "ShmPeerGone", "create_segment",
           "remove_segments_of", "shm_applies", "shm_supported", "sum_into"]
_HEADER = 4096  # pids (int64 per rank), then the flag lines
SLOT_BYTES = 4 << 20  # per rank per half; larger tensors stream through in rounds
_VIEW_CACHE_ENTRIES = 64  # (half, bytes, dtype) -> views; a training run uses a handful
MIN_SLOT_BYTES = 64 << 10
# Below this a rank sums every slot itself: one wait instead of two; above it, dividing the sum
# into chunks saves reading k copies of the whole piece. With two ranks the whole sum reads no
# more than the chunked one (4 bytes moved per byte vs 3.5), so there every round is summed
# whole: each wait can cost a wake-up, ms when the host is busy (seen in `train --trace`).
SMALL_BYTES = 32 << 10
_SET_UP = Tag("set-up")


def _slot_bytes_for(world_size: int, wanted: int) -> int:
    """`wanted`, or less to fit /dev/shm's free space with room to spare (Docker's default is 64 MB)."""
    free = free_bytes()
    if free is None:
        return wanted
    fits = (free // 4) // (2 * (world_size + 1)) // LINE * LINE  # at most a quarter of what is free
    return min(wanted, max(fits, MIN_SLOT_BYTES))


class ShmGroup:
    """One shared segment for the ranks of `world`, or of each host; open it at the same point on
    every rank. Its members are numbered 0..k-1 in segment order (`rank`: this one's index)."""

    def __init__(self, *, world: World, slot_bytes: int = SLOT_BYTES, small_bytes: int | None = None,
                 host: tuple[int, ...] | None = None, compiled: bool = True) -> None:
        """`slot_bytes`: each rank's input slot (a multiple of 64; larger tensors take several
        rounds); `small_bytes`: rounds up to this size are summed whole by every rank (None:
        every round with two ranks, SMALL_BYTES with more). `host`: the global ranks that share
        this rank's host, when each host opens a segment of its own (the hierarchical
        collectives); default: every rank of the world, all on this host. `compiled`: run rounds
        through the compiled kernel where it loads (shm_kernel.py); False: in Python (the same bits;
        what tests and benchmarks compare it with)."""
        if slot_bytes < LINE or slot_bytes % LINE:
            raise ValueError(f"slot_bytes {slot_bytes} must be a positive multiple of {LINE}")
        reason = shm_applies(world, host=host)
        if reason is not None:
            raise ShmError(f"{reason}; use --allreduce native")
        self.world = world
        self.members = tuple(range(world.world_size)) if host is None else tuple(host)
        self.k = len(self.members)
        self.rank = self.members.index(world.rank)
        self.round = 0  # rounds done; the same on every rank, as every rank makes the same calls
        if small_bytes is None:
            small_bytes = slot_bytes if self.k == 2 else SMALL_BYTES
        self.small_bytes = small_bytes
        self.slot_bytes = _slot_bytes_for(self.k, slot_bytes) if self.rank == 0 else 0
        self._mmap: mmap.mmap | None = None  # the segment, mapped by _open
        self._flags: Flags | None = None  # its flag lines (shm_flags.py), once mapped
        # Spinning helps only while every worker has a core of its own; past that it takes the
        # CPU a late peer needs, so oversubscribed workers go straight to the futex.
        self.spin_s = SPIN_S if world.local_world_size <= available_cores() else 0.0
        self.compiled_reason: str | None = "not asked for" if not compiled else None  # why rounds run in Python
        self._open()
        if compiled:
            self._bind_kernel()

    def _open(self) -> None:
        k, rank = self.k, self.rank
        data0 = -(-(_HEADER + k * LINE) // 4096) * 4096  # the slots start on the page after the header
        size = data0 + 2 * (k + 1) * self.slot_bytes  # rank 0's, which creates it
        self._mmap = self._share(size)
        buf = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self._bytes = buf
        pids = memoryview(self._mmap)[:8 * k].cast("q")
        pids[rank] = os.getpid()
        self._pids_view = pids
        # futex words: the low half of each int64 flag
        self._flags = Flags(memoryview(self._mmap)[_HEADER:_HEADER + k * LINE].cast("q"), buf.data_ptr() + _HEADER,
                            pids, world=self.world, members=self.members, rank=rank, spin_s=self.spin_s)
        self._view_cache: dict = {}
        half = (k + 1) * self.slot_bytes
        # self._slot[p][r]: rank r's input slot in half p; self._slot[p][k]: half p's result area.
        self._slot = [[buf[data0 + p * half + i * self.slot_bytes: data0 + p * half + (i + 1) * self.slot_bytes]
                       for i in range(k + 1)] for p in range(2)]
        self._opened()

    def _share(self, size: int) -> mmap.mmap:
        """The segment, mapped by every member (a collective: rank 0 creates, the others attach).
        Rank 0's sizes rule (its slot size follows its free space), so every rank cuts alike."""
        shared = share_segment(self.world, label="", create=lambda path: create_segment(path, size),
                               facts=(self.slot_bytes, self.small_bytes),
                               around=lambda: collective(self.world, _SET_UP), host=self.members)
        self.slot_bytes, self.small_bytes = shared.facts
        if shared.failed is not None:
            if shared.mapping is not None:
                shared.mapping.close()
            r, e = shared.failed
            raise ShmError(f"shared-memory segment unusable on rank {r}: {e}; use --allreduce native")
        return shared.mapping

    def _opened(self) -> None:
        with collective(self.world, _SET_UP):
            dist.barrier()  # every pid is written before anyone may need to name a dead peer

    def _bind_kernel(self) -> None:
        library, self.compiled_reason = shm_kernel.load()
        if library is not None:
            slots = (self._slot[0][0].data_ptr(), self._slot[1][0].data_ptr())
            self._flags.compiled = shm_kernel.Rounds(library, flags_addr=self._flags.address, slots=slots,
                                                     slot_stride=self.slot_bytes, spin_s=self.spin_s, k=self.k,
                                                     rank=self.rank)

    @property
    def timeout_s(self) -> float:
        """How long a wait lasts before it fails naming the late peer (the world's, unless set)."""
        return self._flags.timeout_s

    @timeout_s.setter
    def timeout_s(self, seconds: float) -> None:
        self._flags.timeout_s = seconds

    @property
    def rounds(self) -> str:
        """How rounds run here, as the first line says it: "compiled" or "Python (why)"."""
        return "compiled" if self.compiled_reason is None else f"Python ({self.compiled_reason})"

    def close(self) -> None:
        """Unmap the segment (its file is long gone); safe to call twice."""
        if self._mmap is not None:
            if self._flags is not None:  # drop every export first, and the compiled calls' addresses into it
                self._flags.words = self._flags.pids = self._flags.compiled = None
            self._flags = self._pids_view = self._slot = self._bytes = None
            self._view_cache = {}
            try:
                self._mmap.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping goes when the process does
            self._mmap = None

    def abort(self) -> None:
        """Make a wait in progress (on another thread) raise at its next wake-up: teardown."""
        if self._flags is not None:
            self._flags.aborted = True

    def allreduce(self, flat: torch.Tensor, *, ticket: Ticket | None = None, notes: torch.Tensor | None = None) -> bool:
        """Sum the contiguous 1-D CPU tensor `flat` in place across the group. `ticket`: the call's
        board entry (calls.py), which waits read to name whom they wait for; None: lives and time.
        True when the round itself saw every rank's call carry `ticket`'s tag and size (a call of
        one small round): settle (calls.py) then skips the board's pairing check. `notes`: None, or
        two float64s the NaN/Inf check reads (guards/finite.py): `flat`'s sum on entry is added to
        the first, the summed `flat`'s to the second, in the passes that move the data anyway."""
        if flat.numel() * flat.element_size() <= self.slot_bytes and self._mmap is not None and flat.is_cpu:
            return self._round(flat, ticket, notes)  # one round, the common case: no windows to cut
        for lo, hi in self.windows(flat):
            self._round(flat[lo:hi], ticket, notes)
        return False

    def windows(self, flat: torch.Tensor) -> list[tuple[int, int]]:
        """[lo, hi) of each round `flat` streams through: a slot's worth each, for every collective."""
        if self._mmap is None:
            raise ShmError("ShmGroup is closed")
        if flat.device.type != "cpu":
            raise ShmError(f"the shm collectives need CPU tensors, got one on {flat.device}")
        per_round, numel = max(1, self.slot_bytes // flat.element_size()), flat.numel()
        return [(lo, min(lo + per_round, numel)) for lo in range(0, numel, per_round)]

    def begin(self, numel: int, dtype: torch.dtype) -> tuple[int, list[torch.Tensor], torch.Tensor]:
        """The next round's number g, and half g % 2's input slots and result area (`numel` x `dtype`)."""
        self.round += 1
        return (self.round, *self._views(self.round % 2, numel * dtype.itemsize, dtype))

    def arrive(self, g: int, ticket: Ticket | None) -> None:
        """Publish that this rank's part of round `g` is in place; return once every rank's is."""
        self._flags.publish(ARRIVED, g)
        self._flags.wait(ARRIVED, g, ticket)

    def kernel_for(self, numel: int):
        """The compiled rounds bound to this segment (shm_kernel.Rounds) for a round whose copies and sums
        span `numel` elements; None where rounds run in Python, or on this thread's team (team_is_faster)."""
        return None if shm_kernel.team_is_faster(numel) else self._flags.compiled

    def compiled_round_done(self, g: int, done: int, tags: tuple[int, int], ticket: Ticket | None,
                            rest: Callable[[], None]) -> bool:
        """Flags.compiled_round_done of this segment's round `g`."""
        return self._flags.compiled_round_done(g, done, tags, ticket, rest)

    def write_tags(self, g: int, tags: tuple[int, int]) -> None:
        """Round `g`'s tag words (shm_flags.call_tags), written by a Python round before it publishes arrival."""
        self._flags.write_tags(g % 2, *tags)

    def tags_agree(self, g: int, tags: tuple[int, int]) -> bool:
        """True when every rank's round `g` carried `tags` (read once all arrived)."""
        return self._flags.tags_agree(g % 2, *tags)

    def _views(self, parity: int, nbytes: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Half `parity`'s input slots and result area as `dtype` tensors of `nbytes` (cached:
        making k views costs microseconds, as much as summing a small bucket)."""
        key = (parity, nbytes, dtype)
        views = self._view_cache.get(key)
        if views is None:
            if len(self._view_cache) >= _VIEW_CACHE_ENTRIES:
                self._view_cache.clear()
            half = self._slot[parity]
            views = self._view_cache[key] = ([half[r][:nbytes].view(dtype) for r in range(self.k)],
                                             half[self.k][:nbytes].view(dtype))
        return views

    def _round(self, piece: torch.Tensor, ticket: Ticket | None, notes: torch.Tensor | None = None) -> bool:
        """One round of `piece`; a small one also compares every rank's tag (shm_flags.TAGS): True
        when they all carried `ticket`'s. `notes`: as allreduce's."""
        small = piece.numel() * piece.element_size() <= self.small_bytes
        lo, hi = (0, piece.numel()) if small else chunk_of(piece.numel(), self.k, self.rank, piece.element_size())
        compiled = self.kernel_for(hi - lo) if piece.dtype in shm_kernel.DTYPES else None  # for this rank's sum
        own, summed = (None, None) if notes is None else (notes[0:1], notes[1:2])
        if compiled is not None and small:  # the common case in one call (shm_kernel.c)
            self.round += 1
            g = self.round
            tags = call_tags(ticket, g)
            done = compiled.small_round(g % 2, g, piece, *tags, notes=notes)
            agreed = self.compiled_round_done(g, done, tags, ticket,
                                              rest=lambda: compiled.sum_slots(piece, g % 2, note=summed))
            return ticket is not None and agreed
        g, inputs, result = self.begin(piece.numel(), piece.dtype)
        self._copy(inputs[self.rank], piece, own)
        if small:
            tags = call_tags(ticket, g)
            self.write_tags(g, tags)
        self.arrive(g, ticket)
        if small:
            sum_into(piece, inputs)
            if summed is not None:
                summed.add_(piece.sum())
            return ticket is not None and self.tags_agree(g, tags)
        if hi > lo:
            if compiled is not None:
                compiled.sum_slots(result[lo:hi], g % 2, offset_bytes=lo * piece.element_size())
            else:
                sum_into(result[lo:hi], [x[lo:hi] for x in inputs])
        self._flags.publish(REDUCED, g)
        self._flags.wait(REDUCED, g, ticket)
        self._copy(piece, result, summed)
        return False

    def _copy(self, out: torch.Tensor, source: torch.Tensor, note: torch.Tensor | None) -> None:
        """out = source, and the float64 `note` (None: none) += its sum: in the copy's own pass where
        the kernel runs this round's size and dtype, else by torch's sum after it."""
        kernel = self.kernel_for(source.numel()) if note is not None and source.dtype in shm_kernel.DTYPES else None
        if kernel is not None:
            kernel.copy_noted(out, source, note)
            return
        out.copy_(source)
        if note is not None:
            note.add_(source.sum())

    def __enter__(self) -> "ShmGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

