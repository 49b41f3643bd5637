"""How a launcher and its workers live and die together, so no worker outlives its run.

- A worker asks Linux to SIGKILL it when its parent dies (`die_with_parent`): a launcher killed
  outright cannot run any handler, and its workers would otherwise train on as orphans.
- In the launcher, SIGTERM and SIGHUP (what `timeout`, job schedulers and container stops send)
  raise `Stopped` and SIGINT raises KeyboardInterrupt, so its clean-up runs (the default action of
  SIGTERM would end the launcher alone). The handlers are re-entrant: the first signal raises, any
  later one is absorbed, so a scheduler that escalates with a second SIGTERM 10 ms later cannot
  cut the clean-up short; inside `signals_deferred()` (clean-up, starting a process) the first one
  is held and raised when the block ends. The `phalanx` command installs them for its whole life
  (`install_stop_handlers`, before torch is imported); `stop_on_signals` does it for one launch
  when phalanx is used as a library.
- Each worker leads its own process group (`lead_own_group`: a new session, as torchrun starts
  its workers), which holds whatever the worker starts - DataLoader workers, a script's own
  children. `terminate` ends the group, not the worker alone: SIGTERM, a grace period, SIGKILL
  for what is left, the workers reaped, so no grandchild outlives the run. A worker flushes its
  stdout and stderr on SIGTERM (`flush_on_sigterm`) before it dies of it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from typing import Iterator

from phalanx.atomic import remove_unfinished
from phalanx.errors import Stopped
from phalanx.runtime.procs import group_members

# How long a terminated worker (and what it started) gets to exit on SIGTERM before it is killed.
TERMINATE_GRACE_S = 3.0
# How long a stopped launcher waits for workers that train to save where they stop
# (runtime/stop_request.py); a scheduler's own kill (Kubernetes, Slurm: 30 s) usually comes first.
STOP_GRACE_S = 60.0
# How long an interrupted launcher (Ctrl-C) waits for workers to run their own KeyboardInterrupt
# handling (an emergency save) before taking them down; torchrun's agent waits 30 s.
INTERRUPT_GRACE_S = 10.0
_GROUP_POLL_S = 0.02
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def _libc():
    """This process's C library on Linux (prctl, tgkill), else None."""
    try:
        return ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
    except OSError:
        return None


_LIBC = _libc()


def die_with_parent(parent_pid: int) -> None:
    """Linux: have the kernel SIGKILL this worker when the launcher dies (killed with SIGKILL,
    so no handler of its own could stop us), instead of training on as an orphan."""
    prctl = getattr(_LIBC, "prctl", None)
    if prctl is None:
        return
    prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the launcher died before the request took effect
        os._exit(1)


def lead_own_group() -> None:
    """In a worker: start a new session, so this process leads a group holding everything it starts
    (unless a child leaves it on purpose) and the launcher's `terminate` can end them together.
    Also as under torchrun: a terminal's Ctrl-C reaches the launcher alone, which stops the workers."""
    with contextlib.suppress(OSError):  # already a group leader
        os.setsid()


class _StopState:
    """This process's stop handlers: which signal came first, whether it was raised, how deep the
    deferred blocks are. One per process, as signal handlers are."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.raised = False
        self.deferring = 0

    def handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            return  # already stopping: a second signal must not interrupt the clean-up
        self.signum = signum
        if not self.deferring:
            self.raised = True
            raise _stop_exception(signum)


_STATE = _StopState()


def _stop_exception(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else Stopped(signum)


def _ours(signum: int) -> bool:
    return signal.getsignal(signum) == _STATE.handle


def install_stop_handlers(*, interrupt_only: bool = False) -> None:
    """For the `phalanx` command's whole life: the stop handlers on SIGTERM, SIGHUP and SIGINT
    (on SIGINT alone with `interrupt_only`)."""
    for signum in (signal.SIGINT,) if interrupt_only else STOP_SIGNALS:
        signal.signal(signum, _STATE.handle)


class stop_on_signals:
    """For one launch: the stop handlers the command has not installed already, while it runs
    (SIGINT only if Python's default is in place, so a caller's own Ctrl-C handling is kept), the
    previous ones restored after. Off the main thread it does nothing (handlers can be set from
    the main thread only)."""

    def __enter__(self):
        global _STATE
        self._previous = {}
        try:
            if not any(_ours(signum) for signum in STOP_SIGNALS):
                _STATE = _StopState()  # a launch of its own, not inside the command
            for signum in STOP_SIGNALS:
                if _ours(signum) or (signum == signal.SIGINT and
                                     signal.getsignal(signum) is not signal.default_int_handler):
                    continue
                self._previous[signum] = signal.signal(signum, _STATE.handle)
        except ValueError:  # not the main thread
            pass
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold a stop signal until this block ends (then raise it): for clean-up, and for the few
    lines that create something the clean-up must know about."""
    _STATE.deferring += 1
    try:
        yield
    finally:
        _STATE.deferring -= 1
        if not _STATE.deferring and _STATE.signum is not None and not _STATE.raised and _ours(_STATE.signum):
            _STATE.raised = True
            raise _stop_exception(_STATE.signum)


def ignore_stops_if_stopping() -> None:
    """At the command's end: once a stop signal was seen, ignore any further one. Python resets
    its handlers to the default while the interpreter shuts down, so a second SIGTERM landing
    then would still kill the process (-15 instead of 143) after its "stopped" line."""
    if _STATE.signum is not None:
        for signum in STOP_SIGNALS:
            with contextlib.suppress(ValueError):
                signal.signal(signum, signal.SIG_IGN)


def stop_message(exc: BaseException) -> tuple[str, int]:
    """The command's last line and exit code for a stop: Ctrl-C 130, a signal 128 + its number."""
    if isinstance(exc, Stopped):
        return f"phalanx: {exc}" + ("" if exc.detail else "; every worker was stopped"), exc.exit_code
    where = getattr(exc, "where", None)  # errors.Interrupted: where each rank was when Ctrl-C came
    said = "phalanx: interrupted" + ("; where each rank was:\n" + "\n".join(where) if where else "")
    return said, 128 + signal.SIGINT


def flush_on_sigterm() -> None:
    """In a worker: on SIGTERM flush stdout and stderr and remove the temporary file of a write
    in progress (a checkpoint being saved), then die of the signal as before (the launcher reads
    the exit status). Without this, text still in the buffers is lost and the temporary file of
    an atomic write stays beside its target."""

    def flush_and_die(signum, frame):
        # The stop reaches the worker's DataLoader workers too; torch's SIGCHLD handler raises when one dies,
        # and raised in here it ended the worker with a traceback instead of the signal (a fresh clone, 2026-12-05).
        with contextlib.suppress(Exception):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        remove_unfinished()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # closed, or interrupted inside its own write
                stream.flush()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, flush_and_die)


def line_buffered_output() -> None:
    """In a worker: each line leaves stdout/stderr in one write, when its newline is printed.

    Block-buffered (a file or pipe) the last lines wait in memory and die with a killed worker;
    unbuffered (PYTHONUNBUFFERED) `print` writes text and newline separately, so two ranks' lines
    tear into each other. One write per line is whole on a pipe up to PIPE_BUF (4 KiB) and on
    a terminal or file in practice, and costs one system call per line. A stream that cannot be
    reconfigured (a notebook's, in a worker phalanx.launch forked) is wrapped to the same end:
    ipykernel's sent text and newline as two messages, and two ranks' lines tore."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if hasattr(stream, "reconfigure"):
            with contextlib.suppress(ValueError, OSError):  # a closed stream
                stream.reconfigure(line_buffering=True, write_through=False)
        elif stream is not None and not isinstance(stream, _WholeLines):
            setattr(sys, name, _WholeLines(stream))


class _WholeLines:
    """A text stream's stand-in that hands it whole lines, each in one write; the rest of a line
    waits for its newline or a flush. Anything else is the stream's own."""

    def __init__(self, stream) -> None:
        self._stream, self._partial = stream, ""

    def write(self, text: str) -> int:
        lines, newline, self._partial = (self._partial + text).rpartition("\n")
        if newline:
            self._stream.write(lines + newline)
        return len(text)

    def flush(self) -> None:
        if self._partial:
            self._stream.write(self._partial)
            self._partial = ""
        self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def signal_main_thread(pid: int, signum: int) -> None:
    """`signum` to process `pid`'s main thread (Linux tgkill), not to the process as a whole.

    A signal sent to a process goes to any of its threads not blocking it, the main one first
    unless that one is busy; and Python runs its handlers on the main thread only, at its next
    bytecode. One taken by another thread (gloo's, the communication thread: none block signals)
    does not wake a main thread asleep in a system call: a script's `time.sleep(600)` got its
    KeyboardInterrupt only when the sleep ended, long after the launcher's grace. Sent to the main
    thread, it cuts that call short (EINTR) and the handler runs. Where tgkill is missing
    (not Linux, glibc < 2.30): os.kill. Raises OSError as os.kill does (the process is gone)."""
    tgkill = getattr(_LIBC, "tgkill", None)
    if tgkill is None:
        os.kill(pid, signum)
        return
    if tgkill(pid, pid, signum) != 0:  # a process's main thread has the process's id
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def describe_signal(signum: int) -> str:
    try:
        return f"signal {signal.Signals(signum).name}"
    except ValueError:
        return f"signal {signum}"


def terminate(procs) -> set[int]:
    """End every worker and every live process of its group (`lead_own_group`): SIGTERM, a grace
    period, SIGKILL for what is left; the workers are reaped (the others are init's to reap).
    Returns the pids seen in the groups, workers included, for the launcher's segment clean-up."""
    seen = {proc.pid for proc in procs if proc.pid is not None}
    _signal_all(procs, signal.SIGTERM, seen)
    give_up_at = time.monotonic() + TERMINATE_GRACE_S
    for proc in procs:
        proc.join(max(0.0, give_up_at - time.monotonic()))
    while group_members(p.pid for p in procs if p.pid is not None) and time.monotonic() < give_up_at:
        time.sleep(_GROUP_POLL_S)
    _signal_all(procs, signal.SIGKILL, seen)
    for proc in procs:
        proc.join()
    return seen


def _signal_all(procs, signum: int, seen: set[int]) -> None:
    """`signum` to each worker's group while it has live members (a group id in use cannot be
    reused by another process), else to the worker alone if it still runs (not yet a leader)."""
    groups = group_members(proc.pid for proc in procs if proc.pid is not None)
    for proc in procs:
        members = groups.get(proc.pid, [])
        seen.update(members)
        try:
            if members:
                os.killpg(proc.pid, signum)
                if signum != signal.SIGKILL:  # a stopped process acts on SIGTERM only once continued
                    os.killpg(proc.pid, signal.SIGCONT)
            elif proc.exitcode is None:
                os.kill(proc.pid, signum)
                if signum != signal.SIGKILL:
                    _continue(proc.pid)
        except OSError:
            pass  # gone meanwhile


def _continue(pid: int | None) -> None:
    try:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
    except OSError:
        pass  # already gone
