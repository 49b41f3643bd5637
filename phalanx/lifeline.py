"""How a launcher and its workers live and die together, so no worker outlives its run.

- A worker asks Linux to SIGKILL it when its parent dies (`die_with_parent`): a launcher killed
  outright cannot run any handler, and its workers would otherwise train on as orphans.
- While the launcher supervises, SIGTERM and SIGHUP (what `timeout`, job schedulers and container
  stops send) raise `Stopped` in it (`stop_on_signals`), so its clean-up runs: the default action
  would end the launcher alone.
- `terminate` ends workers: SIGTERM, a grace period, SIGKILL for what is left, all reaped.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

from phalanx.errors import Stopped

# How long a terminated worker gets to exit on SIGTERM before it is killed.
TERMINATE_GRACE_S = 3.0


def die_with_parent(parent_pid: int) -> None:
    """Linux: have the kernel SIGKILL this worker when the launcher dies (killed with SIGKILL,
    so no handler of its own could stop us), instead of training on as an orphan."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the launcher died before the request took effect
        os._exit(1)


class stop_on_signals:
    """While supervising: SIGTERM/SIGHUP raise `Stopped`, so the launcher's clean-up takes the
    workers down (the default action would kill only the launcher and orphan them). Handlers
    can be set from the main thread only; elsewhere this does nothing."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP)

    def __enter__(self):
        self._previous = {}
        try:
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._raise)
        except ValueError:  # not the main thread
            pass
        return self

    @staticmethod
    def _raise(signum, frame):
        raise Stopped(signum)

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def describe_signal(signum: int) -> str:
    try:
        return f"signal {signal.Signals(signum).name}"
    except ValueError:
        return f"signal {signum}"


def terminate(procs) -> None:
    """SIGTERM every live worker, SIGKILL what is left after the grace, and reap them all."""
    for proc in procs:
        if proc.exitcode is None:
            proc.terminate()
            _continue(proc.pid)  # a stopped worker (SIGSTOP, Ctrl-Z) acts on SIGTERM only once continued
    give_up_at = time.monotonic() + TERMINATE_GRACE_S
    for proc in procs:
        proc.join(max(0.0, give_up_at - time.monotonic()))
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()
            proc.join()


def _continue(pid: int | None) -> None:
    try:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
    except OSError:
        pass  # already gone
