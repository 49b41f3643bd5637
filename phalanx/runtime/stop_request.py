"""A stop that keeps the work: SIGTERM during training ends the run at a step boundary, saved.

Schedulers stop jobs with SIGTERM and kill them a grace period later (Kubernetes and Slurm: 30 s
by default, `docker stop`: 10 s); a spot instance's preemption, a `scancel`, a node drain or
torchrun's agent stopping its workers all arrive that way. Without this, everything since the
last checkpoint is lost. While a training loop is `armed`, the first SIGTERM only records the
request (and flushes the output, so no line is lost if a kill follows); the loop asks
`agreed(...)` after each step, every rank at the same steps, and one small summed collective
tells every rank whether any rank was asked to stop, so all stop after the *same* step. The
loop then saves a checkpoint there and raises `Stopped` with the position: resuming it gives
the uninterrupted run's model bit for bit. A second SIGTERM while armed, or any outside
`armed`, acts as before (the worker dies of it, the launcher takes its workers down).

The request is process-wide state because signal handlers are. Arming needs the main thread
(only it may set handlers); elsewhere it does nothing and SIGTERM ends the process as before.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Callable, Iterator

from phalanx.errors import Stopped

STOP_SIGNAL = signal.SIGTERM


class _Request:
    """The first stop signal seen while armed (None: none), and the handlers arming replaced."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.previous: dict[int, object] = {}
        # The signal a peer was asked to stop by, learnt in `agreed`: a rank that got none names it.
        self.peers: int | None = None


_REQUEST = _Request()


def requested() -> int | None:
    """The signal that asked this process to stop while armed, or None."""
    return _REQUEST.signum


def _on_signal(signum: int, frame) -> None:
    if _REQUEST.signum is None:  # the first: finish the step, agree, save, then stop
        _REQUEST.signum = signum
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # closed, or interrupted inside its own write
                stream.flush()
        return
    # A second one: whatever the replaced handler did (die, or raise the launcher's Stopped).
    previous = _REQUEST.previous.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def arm(signals: tuple[int, ...] = (STOP_SIGNAL,)) -> bool:
    """From now on, the first of `signals` is a request that `agreed` reads (for a script's loop:
    until the process ends). False where it cannot be (off the main thread); True if already armed."""
    try:
        if signal.getsignal(signals[0]) is _on_signal:
            return True
        previous = {signum: signal.getsignal(signum) for signum in signals}
        for signum in signals:
            signal.signal(signum, _on_signal)
    except ValueError:  # not the main thread: the signals keep their handlers
        return False
    _REQUEST.signum, _REQUEST.previous, _REQUEST.peers = None, previous, None
    return True


@contextlib.contextmanager
def armed(enabled: bool = True, signals: tuple[int, ...] = (STOP_SIGNAL,)) -> Iterator[bool]:
    """`arm(signals)` while the block runs, the handlers it replaced given back after, and no
    request left pending. Yields whether it armed (not when `enabled` is False, off the main
    thread, or when armed further out). `phalanx train` arms SIGINT too: a Ctrl-C saves as well."""
    if not enabled or signal.getsignal(signals[0]) is _on_signal or not arm(signals):
        yield False
        return
    try:
        yield True
    finally:
        for signum, previous in _REQUEST.previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        _REQUEST.signum, _REQUEST.previous, _REQUEST.peers = None, {}, None


def agreed(sum_over_ranks: Callable[[list[float]], list[float]] | None) -> bool:
    """Whether any rank was asked to stop, the same answer on every rank. `sum_over_ranks(values)`
    sums a short list over the ranks (a collective every rank calls at this point; None in a
    world of one)."""
    if sum_over_ranks is None:
        return _REQUEST.signum is not None
    # One count per armed signal (the same list on every rank), so that every rank names the signal
    # a peer got: a SIGINT sent to rank 1 alone ended the run as "stopped by SIGTERM", exit 143.
    armed_signals = sorted(_REQUEST.previous) or [STOP_SIGNAL]
    counts = sum_over_ranks([1.0 if _REQUEST.signum == signum else 0.0 for signum in armed_signals])
    asked = [signum for signum, count in zip(armed_signals, counts) if count > 0.5]
    if asked and _REQUEST.peers is None:
        _REQUEST.peers = asked[0]
    return bool(asked)


def stopped_at(where: str, saved_in: str) -> Stopped:
    """The exception that ends a run that stopped after a step and saved it."""
    return Stopped(_REQUEST.signum or _REQUEST.peers or STOP_SIGNAL, detail=f"after {where}, saved in {saved_in}; run the same "
                                                         "command with --resume auto to continue")
