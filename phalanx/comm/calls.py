"""A collective call's life on the collective board, the same for every transport: entered under
the `Tag` its caller passed, waited with one deadline, settled once it completed.

Every collective phalanx issues passes through here: the backend's own on the default group
(`native`, and `collective` around the blocking ones), and AsyncComm's shm, hierarchical, ring,
tree and naive (async_ops.py), launched now and waited later or run on the caller's thread (`run_now`);
`run_collective` is the one synchronous form of allreduce, reduce-scatter and all-gather.

- `enter` is the one place a call is written on the board (runtime/board.py), before it starts.
  Its tag says what it is: a gradient bucket of a step, an evaluation, a checkpoint; a user's
  own call may leave it "allreduce", which peers compare by size, kind and dtype alone. Where the
  backend would abort on a size it did not expect (gloo's), the peers that entered already are
  compared before the call starts (`check_peers`).
- `waiting` wraps every wait: the one deadline, the board read at each poll (watchdog.py), a
  backend error turned into the board's diagnosis - and, once the wait returns, `settle`.
- `settle` is the one place that checks, after a call completed, that every peer that entered
  its number entered the same collective (gloo sums two unrelated tensors of one size without a
  word), and lets the board record a settled gradient exchange's step ("after step N"). A job
  whose transport compared every rank's tag inside the collective itself (an shm call of one
  round, shm_flags.TAGS) returns True, and the board's check is skipped: it reads every
  peer's line, which costs a few microseconds per call where the peers are writing theirs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import time
from typing import Callable, Iterator

from phalanx.comm.watchdog import POLL_S, CommError, check, check_pairing, diagnose
from phalanx.errors import RunFailed
from phalanx.runtime.board import COMM, WORLD, Board, Ticket
from phalanx.runtime.tags import Tag
from phalanx.runtime.world import World

_POLL = datetime.timedelta(seconds=POLL_S)


def enter(world: World, channel: int, tag: Tag, size_bytes: int, *, dtype=None,
          check_peers: bool = False) -> Ticket | None:
    """Write this rank's next collective on `channel` on the board; its ticket (None: no board).
    `dtype`: the tensor's, compared with the peers' as its size is. `check_peers`: compare it with
    the peers that entered the same number already, before the call starts: gloo aborts the
    process (SIGABRT, in its own thread) when more bytes come than it expects, so of two ranks
    that disagree the later to enter raises here and never sends, and the earlier sees that
    entry at its first poll. Ranks on other hosts (no board line) are not compared. It costs
    0.5-1.3 us a call on a 2-rank board, against 1.1-1.6 ms for a 4 KB gloo allreduce on the same
    busy 2-core host (2026-12-03; an A/B of 500 calls moved by less than its own noise)."""
    board: Board | None = world.board
    if board is None:
        return None
    ticket = board.enter(channel, tag, size_bytes, dtype)
    if check_peers:
        check_pairing(world, ticket)
    return ticket


def settle(world: World, ticket: Ticket | None, *, paired: bool = False) -> None:
    """After `ticket`'s collective completed: raise if a peer entered its number as another
    collective (`paired`: the transport saw every peer's call carry this tag already); otherwise
    the board records it (a gradient exchange's step is now synced)."""
    if ticket is not None and world.board is not None:
        if not paired:
            check_pairing(world, ticket)
        world.board.settled(ticket)


class waiting:
    """`with waiting(world, ticket) as poll:` around every wait. Publish that this thread waits for
    `ticket`; `poll()` checks with the time waited; a backend error raised inside becomes the
    diagnosis when the board has one; once the body returned, the collective is settled (the body
    sets `paired` when the job's transport compared the peers' tags itself).

    A class rather than a generator context manager: it runs on every collective, and a 4 KB shm
    allreduce costs tens of microseconds in all, of which contextlib's machinery took a few."""

    __slots__ = ("world", "ticket", "started", "paired")

    def __init__(self, world: World, ticket: Ticket | None) -> None:
        self.world, self.ticket = world, ticket
        self.started = 0.0
        self.paired = False

    def __enter__(self) -> Callable[[], None]:
        self.started = time.monotonic()
        if self.world.board is not None and self.ticket is not None:
            self.world.board.block(self.ticket)
        return self.poll

    def poll(self) -> None:
        check(self.world, self.ticket, waited_s=time.monotonic() - self.started, timeout_s=self.world.timeout_s)

    def __exit__(self, kind, exc, traceback) -> None:
        world, ticket = self.world, self.ticket
        if world.board is not None and ticket is not None:
            world.board.unblock()
        if exc is None:
            settle(world, ticket, paired=self.paired)
            return
        if isinstance(exc, (RunFailed, CommError)) or not isinstance(exc, Exception):
            return  # propagates as it is
        found = diagnose(world, ticket, exc, waited_s=time.monotonic() - self.started, timeout_s=world.timeout_s)
        if found is not None:
            raise found from exc


def run_now(world: World, channel: int, tag: Tag, size_bytes: int,
            job: Callable[[Ticket | None], bool | None], *, dtype=None, check_peers: bool = False) -> None:
    """Run a collective to its end on this thread: `job(ticket)` does the work (a transport that
    polls, as shm does, reads the ticket to name whom it waits for) and returns True when its
    transport compared every peer's tag itself."""
    ticket = enter(world, channel, tag, size_bytes, dtype=dtype, check_peers=check_peers)
    call = waiting(world, ticket)
    with call:
        call.paired = job(ticket) is True


def run_collective(world: World, algorithm: str, tag: Tag, flat, *, start: Callable[[], object],
                   job: Callable[[object, Ticket | None], bool | None], transport=None) -> None:
    """One collective of any kind to its end on this thread, outside AsyncComm: `native` through
    `start()` (the backend's async op on the default group), any other algorithm as
    `job(transport, ticket)`. Without a transport it runs on the default group and pairs with the
    world's collectives; a transport handed in (a segment, a private group) orders its own."""
    size_bytes = flat.numel() * flat.element_size()
    if algorithm == "native":
        native(world, tag, start, size_bytes=size_bytes, dtype=flat.dtype)
    else:  # shm compares every rank's tag inside the round, so a mismatch there is a line already
        run_now(world, WORLD if transport is None else COMM, tag, size_bytes, lambda ticket: job(transport, ticket),
                dtype=flat.dtype, check_peers=algorithm != "shm")


def wait_work(work, *, world: World, ticket: Ticket | None) -> None:
    """Wait for a backend `Work` with the board watched (gloo's, polled); NCCL's is a stream wait."""
    with waiting(world, ticket) as poll:
        if world.backend != "gloo":
            work.wait()
            return
        while True:
            try:
                work.wait(_POLL)
                break
            except RuntimeError:
                if work.is_completed():  # it failed, or completed just after this poll timed out
                    work.wait()  # returns for the latter; raises the collective's own error, which `waiting` explains
                    break
            poll()  # outside the except: a diagnosis is not "raised while handling a poll timeout"


def when_completed(on_done: Callable[[], None]) -> Callable[[object], None]:
    """A done-callback for a collective's future (AsyncComm's thread's, or a backend work's) that
    runs `on_done()` only if the collective completed: not for a job close() cancelled, one refused
    after an earlier failure (it never ran) or one that failed, which a trace (Tracer.comm_done)
    would otherwise draw as a finished exchange and count in its bandwidth."""
    def callback(future) -> None:
        if isinstance(future, concurrent.futures.Future):
            completed = not future.cancelled() and future.exception() is None
        else:  # torch's Future: value() raises the backend's error
            try:
                future.value()
                completed = True
            except Exception:  # noqa: BLE001 - any error: the collective did not complete
                completed = False
        if completed:
            on_done()
    return callback


def wait_future(future: concurrent.futures.Future, *, world: World, ticket: Ticket | None) -> None:
    """Wait for a job on AsyncComm's thread with the board watched from this thread too, so a
    deadlock is seen wherever the ranks are blocked; the job's result True: its transport
    compared every peer's tag itself."""
    call = waiting(world, ticket)
    with call as poll:
        while True:
            try:
                call.paired = future.result(timeout=POLL_S) is True
                return
            except concurrent.futures.TimeoutError:
                pass
            poll()


@contextlib.contextmanager
def collective(world: World, tag: Tag, *, size_bytes: int = 0) -> Iterator[None]:
    """Around a blocking collective on the default group that cannot be polled (all_gather_object,
    barrier): peers see where this rank is, and a backend error becomes the board's diagnosis."""
    if not world.distributed:
        yield
        return
    with waiting(world, enter(world, WORLD, tag, size_bytes)):
        yield


def native(world: World, tag: Tag, start: Callable[[], object], *, size_bytes: int, dtype=None) -> None:
    """Run a backend collective on the default group: `start()` launches it with async_op=True,
    once the peers that entered it already are seen to agree (`enter`'s check_peers)."""
    ticket = enter(world, WORLD, tag, size_bytes, dtype=dtype, check_peers=True)
    wait_work(start(), world=world, ticket=ticket)
