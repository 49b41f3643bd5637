"""The collective board: where each local rank says which collective it is in, so that a wait
that goes wrong can name the rank and the collective at fault.

Ranks pair collectives by order: the n-th call on a channel of one rank meets the n-th of every
other. When one rank runs a step more, skips an evaluation or freezes, the others wait - until a
timeout that names nobody, or, worse, until two different collectives of equal size are summed
together without a word (gloo does that). torch's TORCH_DISTRIBUTED_DEBUG=DETAIL checks every
call against its peers' over the store, at a round trip per collective; this board is the cheap,
always-on form for the ranks of one host: a few stores into shared memory per collective, and
reads only where a rank waits anyway.

Each local rank owns one line (LINE_WORDS int64 words, about a kilobyte; only its owner writes
it). Per channel - WORLD: the default process group, where the backend's own collectives pair in
call order; COMM: AsyncComm's single thread (the shm segment or the private group of ring, tree,
naive) - it keeps a count of collectives entered and, in a ring of RING_SLOTS, the tag of each
recent one as its caller named it (a `Tag`, tags.py: phase - gradient bucket, evaluation,
metrics, broadcast, checkpoint, ... -, bucket index, step, and the kind of collective) and its
size in bytes. While its calling thread
waits for a collective, the line says which one (BLOCK_*), since when, and a serial that changes
with every wait, so a reader can take a consistent snapshot without a lock (a seqlock). The line
also holds the pid, whether the rank finished its work normally or failed, and the last step
whose gradient exchange it settled: what "after step N" says, and the step of a tag that names
none (a user's own call, e.g. "evaluation after step 75"), and, in `phalanx train`, the last step
its job finished with that step's running sums: what the survivors of a dead rank save for it.

What the board is not: it moves no data and decides nothing; `watchdog.py` reads it while
waiting. Its memory is a /dev/shm segment the local ranks open together right after joining
(`open_board`: phalanx's launcher and `phalanx run` alike), unlinked once mapped, so nothing can
be left behind. A world with no board (one rank, or ranks on several hosts under torchrun) still
has deadlines; it cannot name peers' collectives.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import time
from array import array
from typing import Callable, NamedTuple

from phalanx.runtime.segment import create_segment, share_segment, shm_supported
from phalanx.runtime.tags import Tag, gradient_step, with_dtype
from phalanx.runtime.world import World

WORLD, COMM = 0, 1  # channels: the default process group; AsyncComm's thread (shm / private group)
RING_SLOTS = 32  # recent tags kept per channel; more than a step's buckets, so a peer ahead stays readable
_PID, _RANK, _STATE, _SERIAL, _SINCE_NS, _BLOCK_CH, _BLOCK_SEQ, _BLOCK_CODE, _BLOCK_SIZE, _STEPS = range(10)
_ENTERED = 10  # + channel: collectives entered on that channel so far
_POSTED, _TOTALS = 12, 13  # the last step its job posted (+1; 0: none), then that step's 4 running sums (float64)
_WRITTEN = 17  # the step this rank saved for the survivors of a dead one (job/survivors.py; 0: none)
_RING = 20  # + (channel * RING_SLOTS + seq % RING_SLOTS) * 2: the tag code, then the size in bytes
LINE_WORDS = _RING + 2 * RING_SLOTS * 2
RUNNING, WAITING, FINISHED, FAILED = 0, 1, 2, 3

class Ticket(NamedTuple):
    """One collective as this rank entered it: which channel, its number there, tag and size."""

    channel: int
    seq: int
    code: int
    size_bytes: int


class Line(NamedTuple):
    """A consistent snapshot of one rank's line."""

    rank: int
    pid: int
    state: int
    serial: int
    since_ns: int
    block: Ticket | None  # what it waits for, when state == WAITING
    steps: int  # the last step whose gradient exchange it settled
    entered: tuple[int, ...]
    last_block: Ticket | None = None  # what it waited for last, whatever its state now


class Board:
    """This process's view of the board: it writes line `local_rank`, reads every line."""

    def __init__(self, memory, *, rank: int, local_rank: int, local_world_size: int, world_size: int,
                 pid: int | None = None) -> None:
        """`memory`: a writable buffer of LINE_WORDS int64 per local rank, shared by them; `pid`:
        the process this line speaks for (default: this one)."""
        words = memoryview(memory).cast("B").cast("q")
        if len(words) < LINE_WORDS * local_world_size:
            raise ValueError(f"board memory holds {len(words)} words, {LINE_WORDS * local_world_size} needed")
        self._words = words
        self._floats = memoryview(memory).cast("B").cast("d")  # the same memory, for the posted sums
        self.rank, self.local_rank = rank, local_rank
        self.local_world_size, self.world_size = local_world_size, world_size
        self.first_rank = rank - local_rank  # launchers number the ranks of one host contiguously
        self._base = local_rank * LINE_WORDS
        self._memory = memory  # keep the mapping alive as long as the view
        words[self._base + _PID] = os.getpid() if pid is None else pid
        words[self._base + _RANK] = rank
        self.on_step: Callable[[int], None] | None = None  # told each newly synced step (settled)

    @property
    def covers_world(self) -> bool:
        """True when every rank of the world has a line here (all on this host)."""
        return self.local_world_size == self.world_size

    def local_index(self, rank: int) -> int | None:
        index = rank - self.first_rank
        return index if 0 <= index < self.local_world_size else None

    # --- writes, by the owner of the line: a few stores each, no syscalls ----------------------

    def enter(self, channel: int, tag: Tag, size_bytes: int, dtype: object = None) -> Ticket:
        """Record that this rank issues its next collective on `channel` (carrying a tensor of
        `dtype`, when said); return its ticket."""
        w, base = self._words, self._base
        code = with_dtype(tag.code(w[base + _STEPS]), dtype)
        seq = w[base + _ENTERED + channel] + 1
        slot = base + _RING + (channel * RING_SLOTS + seq % RING_SLOTS) * 2
        w[slot] = code
        w[slot + 1] = size_bytes
        w[base + _ENTERED + channel] = seq  # published last: a reader that sees seq sees its tag
        return Ticket(channel, seq, code, size_bytes)

    def block(self, ticket: Ticket) -> None:
        """This rank's calling thread now waits for `ticket`'s collective."""
        w, base = self._words, self._base
        w[base + _BLOCK_CH], w[base + _BLOCK_SEQ] = ticket.channel, ticket.seq
        w[base + _BLOCK_CODE], w[base + _BLOCK_SIZE] = ticket.code, ticket.size_bytes
        w[base + _SINCE_NS] = time.monotonic_ns()
        w[base + _SERIAL] += 1
        w[base + _STATE] = WAITING

    def unblock(self) -> None:
        self._words[self._base + _STATE] = RUNNING

    def settled(self, ticket: Ticket) -> None:
        """`ticket`'s collective completed on this rank; once a step's gradient exchange has, that
        step is the last this rank synced (what peers say "after step N" of, and what a tag
        without a step is filled in with)."""
        step = gradient_step(ticket.code)
        if step is not None:
            self._words[self._base + _STEPS] = step + 1
            if self.on_step is not None:
                self.on_step(step + 1)

    def post(self, global_step: int, totals: list[float]) -> None:
        """The job finished `global_step` with these running sums (job/survivors.py reads a dead
        peer's): no step while the sums change, then the step, so a reader that sees a step twice
        around its read of the sums read that step's."""
        self._words[self._base + _POSTED] = 0
        self._floats[self._base + _TOTALS:self._base + _TOTALS + 4] = array("d", totals[:4])
        self._words[self._base + _POSTED] = global_step + 1

    def posted(self, local_rank: int) -> tuple[int, list[float]] | None:
        """(step, sums) a rank last posted, None before its first post (or if it kept changing)."""
        base = local_rank * LINE_WORDS
        for _ in range(8):
            step = self._words[base + _POSTED]
            totals = self._floats[base + _TOTALS:base + _TOTALS + 4].tolist()
            if step == 0:
                return None
            if self._words[base + _POSTED] == step:
                return step - 1, totals
        return None

    def written(self, local_rank: int) -> int:
        return self._words[local_rank * LINE_WORDS + _WRITTEN]

    def mark_written(self, global_step: int) -> None:
        self._words[self._base + _WRITTEN] = global_step

    def mark(self, state: int) -> None:
        """FINISHED (the worker's work returned) or FAILED (it raised): what peers will be told."""
        self._words[self._base + _STATE] = state

    # --- reads ---------------------------------------------------------------------------------

    def line(self, local_rank: int) -> Line | None:
        """A consistent snapshot of a rank's line (None if it kept changing under the reader)."""
        w, base = self._words, local_rank * LINE_WORDS
        for _ in range(8):
            serial, state = w[base + _SERIAL], w[base + _STATE]
            block = Ticket(w[base + _BLOCK_CH], w[base + _BLOCK_SEQ], w[base + _BLOCK_CODE], w[base + _BLOCK_SIZE])
            since_ns = w[base + _SINCE_NS]
            entered = (w[base + _ENTERED + WORLD], w[base + _ENTERED + COMM])
            steps = w[base + _STEPS]
            if w[base + _SERIAL] == serial and w[base + _STATE] == state:
                return Line(rank=w[base + _RANK], pid=w[base + _PID], state=state, serial=serial, since_ns=since_ns,
                            block=block if state == WAITING else None, steps=steps, entered=entered,
                            last_block=block if serial else None)
        return None

    def lines(self) -> list[Line | None]:
        return [self.line(r) for r in range(self.local_world_size)]

    def tag_of(self, local_rank: int, channel: int, seq: int) -> tuple[int, int] | None:
        """(code, size) of a rank's collective number `seq` on `channel`, if it entered it and the
        ring still holds it; None otherwise."""
        w, base = self._words, local_rank * LINE_WORDS
        entered = base + _ENTERED + channel
        if not seq <= w[entered] < seq + RING_SLOTS:
            return None
        slot = base + _RING + (channel * RING_SLOTS + seq % RING_SLOTS) * 2
        code, size = w[slot], w[slot + 1]
        return (code, size) if w[entered] < seq + RING_SLOTS else None  # not overwritten meanwhile

    def all_entered_as(self, ticket: Ticket) -> bool:
        """True when every local rank's collective number `ticket.seq` on its channel is in the
        ring with `ticket`'s code and size: the common case of a completed collective, read with
        a few strided slices whatever the rank count (a peer at a time cost a microsecond each)."""
        w, n, stride = self._words, self.local_world_size, LINE_WORDS
        entered_at = _ENTERED + ticket.channel
        slot = _RING + (ticket.channel * RING_SLOTS + ticket.seq % RING_SLOTS) * 2
        entered = w[entered_at:entered_at + n * stride:stride].tolist()
        if min(entered) < ticket.seq or max(entered) >= ticket.seq + RING_SLOTS:
            return False
        codes = w[slot:slot + n * stride:stride].tolist()
        sizes = w[slot + 1:slot + 1 + n * stride:stride].tolist()
        if codes.count(ticket.code) != n or sizes.count(ticket.size_bytes) != n:
            return False
        return max(w[entered_at:entered_at + n * stride:stride].tolist()) < ticket.seq + RING_SLOTS  # not reused


def attach_board(world: World, memory) -> World:
    """`world` with a board over `memory` (None: `world` unchanged)."""
    if memory is None:
        return world
    board = Board(memory, rank=world.rank, local_rank=world.local_rank, local_world_size=world.local_world_size,
                  world_size=world.world_size)
    return dataclasses.replace(world, board=board)


def mark_exit(world: World | None, *, ok: bool) -> None:
    """Tell peers this rank's work ended: normally (`ok`) or by an error."""
    if world is not None and world.board is not None:
        world.board.mark(FINISHED if ok else FAILED)


def synced_steps(world: World | None) -> int | None:
    """The last step whose gradient exchange this rank settled, when it has a board to say so."""
    return None if world is None or world.board is None else int(world.board._words[world.board._base + _STEPS])


def open_board(world: World) -> World:
    """The local ranks open a board together (a collective: call it at the same point on every
    rank, right after joining). Only when every rank is on this host and it has /dev/shm;
    otherwise `world` is returned without one. At interpreter exit the line says how the process
    ended (FAILED when an exception went uncaught)."""
    if not world.distributed or world.board is not None or world.local_world_size != world.world_size \
            or shm_supported() is not None:
        return world
    shared = share_segment(world, label="board-",
                           create=lambda path: create_segment(path, LINE_WORDS * 8 * world.world_size))
    if shared.failed is not None:
        return world
    world = attach_board(world, shared.mapping)
    atexit.register(_mark_at_exit, world.board)
    return world


def _mark_at_exit(board: Board) -> None:
    line = board.line(board.local_rank)
    if line is not None and line.state not in (FINISHED, FAILED):
        # The default excepthook sets sys.last_value before atexit runs: the script raised.
        board.mark(FAILED if getattr(sys, "last_value", None) is not None else FINISHED)
