"""The fork guard's parts (phalanx/runtime/fork_guard.py); tests/distributed/test_fork_guard.py
forks children while native threads make Python thread states."""

from __future__ import annotations

import threading

from phalanx.runtime import fork_guard


def test_needed_before_python_3_12_only():
    assert fork_guard.needed((3, 10)) and fork_guard.needed((3, 11))
    assert not fork_guard.needed((3, 12)) and not fork_guard.needed((3, 13))


def test_threads_that_threading_started_are_not_waited_for():
    """A Python thread makes its thread state with the GIL held, so it cannot hold the lock at a fork."""
    stop = threading.Event()
    spinner = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)], daemon=True)
    spinner.start()
    try:
        assert spinner.native_id not in fork_guard.running_native_threads()
    finally:
        stop.set()
        spinner.join()
