"""One deadline per wait, and a diagnosis that names the right rank and the right collective.

Every wait for a collective polls (`POLL_S`: a blocked rank costs nothing, and a healthy
collective returns at once, so the normal path pays only the board's few stores; calls.py runs
the waits) and at each poll `check` reads the board (board.py) and the peers' processes:

1. Pairing: a peer that entered this collective's number on this channel with another tag, kind,
   size or dtype (only those three, when either call is a generic "allreduce") is in a different
   collective - fail now, naming both ("rank 1 is in evaluation after step 75 (24 B), from
   phalanx.evaluate or evaluate_dataset; rank 0 in step 76's gradient bucket 0 (5.5 KiB)": what
   in a script issues each phase, tags.called_by), before the backend sums
   two unrelated tensors or waits for bytes that never come. Checked again once a collective
   completes (`check_pairing`, from calls.settle), since gloo pairs equal sizes without a word.
2. A peer that has not entered it and never will: it finished its work normally (reported as
   such, not as a death), failed, or died.
3. Deadlock: every rank of the world waits (on this host, all visible), and every one's
   collective lacks a rank that has not entered it - e.g. rank 0 in a gradient bucket on the
   communication thread, rank 1 in evaluation's allreduce on the default group. Two passes over
   the board with unchanged wait serials prove that every rank was blocked in those waits at one
   instant; with entries made only by threads that are blocked, nothing can change it.
4. The deadline, counted once from the start of the wait whatever else is in flight (queued
   collectives behind a failed one fail at once: async_ops.py): the error names the peer that
   never arrived and what its process is doing (/proc: a stopped process shows state T). A live
   peer outside every collective is named as busy, not as "stopped responding": most often
   rank 0's own work (nanoGPT's sampling or checkpoint under `master_process`) outlasting the
   timeout, the cause script_errors.py names for a torch collective's timeout too.

Errors whose message is the whole story (a stalled, finished or mismatched peer) are `RunFailed`,
so a launcher prints that one line; a peer that died or failed is a plain error, so the launcher
names that peer's own report as the root cause.
"""

from __future__ import annotations

from phalanx.runtime.board import FAILED, FINISHED, RUNNING, WAITING, Board, Line, Ticket
from phalanx.runtime.tags import called_by, describe, dtype_of, gradient_step, is_generic, op_of, without_dtype
from phalanx.runtime.procs import STOPPED, process_alive, process_state
from phalanx.errors import PeerLost, RunFailed
from phalanx.runtime.world import World

POLL_S = 0.5  # how often a blocked wait looks at the board and at the clock
_STATE_WORDS = {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O", "T": "stopped",
                "t": "stopped by a debugger", "Z": "dead", "X": "dead"}


class CollectiveMismatch(RunFailed):
    """Ranks are in different collectives: the order of calls differs between them."""


class PeerStalled(RunFailed):
    """A peer did not arrive within the deadline (`culprit`: that peer, when one is known)."""

    restartable = True  # a frozen or starved worker is the machine's doing: a restart may get past it

    def __init__(self, message: str, *, culprit: int | None = None) -> None:
        super().__init__(message)
        self.culprit = culprit


class PeerFinished(RunFailed):
    """A peer's work ended normally while this rank waits for it in a collective."""


class CommError(RuntimeError):
    """A collective failed and the message already says why: waits pass it on unchanged."""


class PeerGone(CommError, PeerLost):
    """A peer died or failed while this rank waited; its own report says why."""


def check(world: World, ticket: Ticket | None, *, waited_s: float, timeout_s: float,
          pending: list[int] | None = None) -> None:
    """Raise if the collective `ticket` waits for cannot complete, or waited past `timeout_s`.

    `pending`: the ranks known not to have arrived (shm reads its flags); default: the ranks
    whose board line has not entered the collective."""
    board: Board | None = world.board
    if board is None or ticket is None:
        if waited_s > timeout_s:
            raise PeerStalled(f"rank {world.rank} waited {waited_s:.0f} s for a collective, past the {timeout_s:g} s "
                              "timeout; raise --timeout if a step can really take that long")
        return
    error = pairing_error(board, ticket)
    if error is not None:
        raise error
    lines = board.lines()
    lacking = _lacking(board, lines, ticket) if pending is None else [board.local_index(r) for r in pending]
    lacking = [i for i in lacking if i is not None]
    for i in lacking:
        error = _gone(board, lines[i], ticket)
        if error is not None:
            raise error
    error = _deadlock(board)
    if error is not None:
        raise error
    if waited_s > timeout_s:
        raise _stalled(board, lines, lacking, ticket, waited_s, timeout_s)


def check_pairing(world: World, ticket: Ticket | None) -> None:
    """After a collective completed: raise if a peer entered its number with another tag."""
    if ticket is not None and world.board is not None:
        error = pairing_error(world.board, ticket)
        if error is not None:
            raise error


def pairing_error(board: Board, ticket: Ticket) -> CollectiveMismatch | None:
    if board.all_entered_as(ticket):
        return None
    for i in range(board.local_world_size):
        if i == board.local_rank:
            continue
        theirs = board.tag_of(i, ticket.channel, ticket.seq)
        if theirs is None:
            continue
        code, size = theirs
        sizes_differ = bool(size and ticket.size_bytes and size != ticket.size_bytes)
        # A generic call ("allreduce": the caller said not what it is for, e.g. SyncBatchNorm's)
        # has no fingerprint but its size, kind and dtype (an allreduce never pairs with a reduce-scatter);
        # named calls must agree on phase, bucket and step too.
        kinds_differ = op_of(code) != op_of(ticket.code)
        theirs_dtype, mine_dtype = dtype_of(code), dtype_of(ticket.code)
        dtypes_differ = bool(theirs_dtype and mine_dtype and theirs_dtype != mine_dtype)
        generic = is_generic(code) or is_generic(ticket.code)
        theirs = Ticket(ticket.channel, ticket.seq, code, size)
        if dtypes_differ and not kinds_differ and (generic or without_dtype(code) == without_dtype(ticket.code)):
            return _dtype_mismatch(board, board.first_rank + i, theirs, ticket)
        if sizes_differ or kinds_differ or dtypes_differ or (code != ticket.code and not generic):
            return _mismatch(board, board.first_rank + i, theirs, ticket)
    return None


def gone_error(world: World, rank: int, ticket: Ticket | None) -> BaseException | None:
    """How `rank`'s board line says it went, for a waiter that found the peer's process gone:
    PeerFinished if its work ended normally (the exit may beat the waiter's poll, and is no
    death), else PeerGone naming its last step and the collective waited in; None without a
    board line to read."""
    board = world.board
    index = None if board is None or ticket is None else board.local_index(rank)
    line = None if index is None else board.line(index)
    return None if line is None else _gone(board, line, ticket)


def diagnose(world: World, ticket: Ticket | None, exc: BaseException, *, waited_s: float,
             timeout_s: float) -> BaseException | None:
    """The error that explains a backend's failure (a timeout, a closed connection), or None."""
    try:
        check(world, ticket, waited_s=waited_s, timeout_s=timeout_s)
    except (RunFailed, CommError) as found:
        return found
    text = str(exc).lower()
    if ("timed out" in text or "timeout" in text) and world.board is not None and ticket is not None:
        # The backend's own deadline (counted from the launch, which may precede this wait).
        lines = world.board.lines()
        return _stalled(world.board, lines, _lacking(world.board, lines, ticket), ticket, max(waited_s, timeout_s),
                        timeout_s)
    return None


# --- the rules ------------------------------------------------------------------------------------

def _lacking(board: Board, lines: list[Line | None], ticket: Ticket) -> list[int]:
    return [i for i, line in enumerate(lines) if i != board.local_rank and line is not None
            and line.entered[ticket.channel] < ticket.seq]


def _gone(board: Board, line: Line | None, ticket: Ticket) -> BaseException | None:
    """A peer that will never enter `ticket`'s collective, as an error; None if it still may."""
    if line is None:
        return None
    me, mine = board.rank, describe(ticket.code, ticket.size_bytes)
    if line.state == FINISHED:
        return PeerFinished(f"rank {line.rank} finished its work normally{_after(line)} while rank {me} waits for it "
                            f"in {mine}{_callers(ticket.code)}; every rank must make the same collective calls (did "
                            f"rank {line.rank} run fewer steps or skip a collective?)")
    if line.state == FAILED:
        return PeerGone(f"rank {line.rank} failed{_after(line)} while rank {me} waited for it in {mine}")
    if line.pid and not process_alive(line.pid):
        return PeerGone(f"rank {line.rank} (pid {line.pid}) died{_after(line)} while rank {me} waited for it in {mine}")
    return None


def _deadlock(board: Board) -> CollectiveMismatch | None:
    """Every rank blocked, none of their collectives complete-able: the rule 3 of the docstring."""
    if not board.covers_world:
        return None  # ranks on other hosts are not on this board: no proof possible
    first = board.lines()
    if any(line is None or line.state != WAITING for line in first):
        return None
    lines = board.lines()  # unchanged serials: every rank was blocked in these waits at one instant
    if any(b is None or b.state != WAITING or b.serial != a.serial for a, b in zip(first, lines)):
        return None
    missing = [[j for j, other in enumerate(lines) if other.entered[line.block.channel] < line.block.seq]
               for line in lines]
    if not all(missing):
        return None  # some collective has every rank: it will complete, and others may follow
    mine, other = lines[board.local_rank], lines[missing[board.local_rank][0]]
    return _mismatch(board, other.rank, other.block, mine.block, mine_steps=mine.steps, theirs_steps=other.steps)


def _stalled(board: Board, lines: list[Line | None], lacking: list[int], ticket: Ticket, waited_s: float,
             timeout_s: float) -> RunFailed:
    """The deadline passed: name the peer that stopped answering, and how its process is."""
    me, mine = board.rank, describe(ticket.code, ticket.size_bytes)
    candidates = lacking or [i for i in range(board.local_world_size) if i != board.local_rank]
    states = {i: process_state(lines[i].pid) if lines[i] is not None and lines[i].pid else None for i in candidates}
    # A stopped process explains the wait best; then one that has not entered the collective.
    chosen = next((i for i in candidates if states[i] in STOPPED), candidates[0] if candidates else None)
    waited = f"rank {me} waited {waited_s:.0f} s in {mine}"
    if not lacking and (chosen is None or states[chosen] not in STOPPED):
        return PeerStalled(f"{waited}: every rank entered it, but it did not complete within the {timeout_s:g} s "
                           "timeout; raise --timeout if a step can really take that long")
    if chosen is None or lines[chosen] is None:
        return PeerStalled(f"{waited}, past the {timeout_s:g} s timeout; raise --timeout if a step can really take that long")
    line, state = lines[chosen], states[chosen]
    word = _STATE_WORDS.get(state or "", state or "unknown")
    text = f"worker rank {line.rank} stopped responding (state: {word}){_after(line)}; {waited}"
    if state in STOPPED:
        # Before the mismatch rule: a rank stopped inside a wait still shows the collective it was
        # in, which its peers may have completed and left (shm: rank 0 sums bucket 1 while stopped
        # rank 1 never read bucket 0's result). The stop is the cause, not the order of calls.
        return PeerStalled(f"{text} (SIGSTOP, Ctrl-Z or a debugger?)", culprit=line.rank)
    if line.state == WAITING and line.block is not None and chosen in lacking:
        return _mismatch(board, line.rank, line.block, ticket)
    ended = line.last_block
    own = board.line(board.local_rank)
    if line.state == RUNNING and chosen in lacking and ended is not None and own is not None \
            and ended.seq > own.entered[ended.channel]:
        # Its wait ended in a collective this rank never entered, so it cannot have completed: its own
        # deadline ran out too, and it fails (read between the end of its wait and its FAILED mark).
        return _mismatch(board, line.rank, ended, ticket)
    if line.state == RUNNING:  # alive, outside every collective: its own work outlasted the timeout
        return PeerStalled(f"worker rank {line.rank} was outside any collective (state: {word}){_after(line)} "
                           f"while rank {me} waited {waited_s:.0f} s in {mine}, past the {timeout_s:g} s timeout: work on rank "
                           f"{line.rank} alone (sampling, an evaluation or a save on rank 0 only?) took that long, or "
                           "it never made the call; raise --timeout, or have every rank take part in that work",
                           culprit=line.rank)
    return PeerStalled(f"{text}: rank {line.rank} did not arrive within the {timeout_s:g} s timeout; "
                       "raise --timeout if a step can really take that long", culprit=line.rank)


def _mismatch(board: Board, rank: int, theirs: Ticket, mine: Ticket, *, mine_steps: int | None = None,
              theirs_steps: int | None = None) -> CollectiveMismatch:
    exact = describe(theirs.code, theirs.size_bytes) == describe(mine.code, mine.size_bytes)  # two "7.6 MiB"
    theirs_text, mine_text = (describe(t.code, t.size_bytes, exact=exact) for t in (theirs, mine))
    text = (f"ranks are in different collectives: rank {rank} is in {theirs_text}{_callers(theirs.code)}; "
            f"rank {board.rank} in {mine_text}{_callers(mine.code)}")
    if mine_steps is not None and theirs_steps is not None and mine_steps != theirs_steps:
        text += f" (rank {board.rank} has synced {mine_steps} steps, rank {rank} {theirs_steps})"
    return CollectiveMismatch(f"{text}; every rank must make the same collective calls in the same order"
                              f"{_one_rank_call(rank, theirs, board.rank, mine)}")


def _one_rank_call(rank: int, theirs: Ticket, me: int, mine: Ticket) -> str:
    """Where one rank is in a call a script makes (a checkpoint, a reduce) and the other trains on into
    its next step's gradient: the usual cause, that call under `if world.is_main:`, and its fix."""
    callers = [(r, called_by(t.code)) for r, t in ((rank, theirs), (me, mine))]
    calling = [(r, said) for r, said in callers if said and said.startswith("phalanx.")]
    if len(calling) != 1 or gradient_step((mine if calling[0][0] == rank else theirs).code) is None:
        return ""
    (caller, said), = calling
    saves = "; phalanx.checkpoint writes the file from rank 0 itself" if said.startswith("phalanx.checkpoint") else ""
    return f": if rank {caller} made that call alone (under `if world.is_main:`), make it on every rank{saves}"


def _dtype_mismatch(board: Board, rank: int, theirs: Ticket, mine: Ticket) -> CollectiveMismatch:
    """The same collective on tensors of two dtypes: the backend would sum bytes of one as the
    other, or abort on a size it did not expect."""
    a, b = dtype_of(theirs.code), dtype_of(mine.code)
    return CollectiveMismatch(
        f"ranks pass tensors of different dtypes to {describe(mine.code)}{_callers(mine.code)}: rank {rank} {a} "
        f"({theirs.size_bytes:,} B), rank {board.rank} {b} ({mine.size_bytes:,} B); every rank must pass the same "
        f"dtype: cast to one on every rank first (tensor.to(torch.{a}) or .to(torch.{b}))")


def _callers(code: int) -> str:
    """", from phalanx.checkpoint, ...": what in a script issues it, for a user who never called it by that name."""
    said = called_by(code)
    return f", from {said}" if said else ""


def _after(line: Line) -> str:
    return f" after step {line.steps}" if line.steps else ""
