"""A fork in a worker must not copy a lock that a native thread holds: before CPython 3.12, it can.

CPython 3.11 and earlier, in the child of `os.fork()`, delete the parent's other thread states
under the interpreter's thread-list lock (HEAD_LOCK) before they re-create that lock (CPython
gh-112275, fixed in 3.12). A native thread takes the lock without the GIL when it makes itself a
Python thread state - as torch's gloo threads do after every collective, to drop a tensor's
Python object (TensorImpl::decref_pyobject -> pybind11::gil_scoped_acquire -> PyThreadState_New).
A fork at that instant gives a child that waits for the lock forever inside `os.fork()`: a
DataLoader worker forked right after a collective never started, and its rank waited for its
first batch until the run's timeout ended it (1 run in ~70 of `phalanx run --devices cpu:2 ...
loader_workers.py --kill` on 2 busy cores, 2026-12-05; the hung child's stack ended in
`_PyThreadState_DeleteExcept`).

`guard_forks()` registers, once per process, a hook that runs before every fork of it, with the
GIL held (os.register_at_fork): it waits until no native thread of the process - one `threading`
did not start, such as gloo's, OpenMP's or a ctypes callback's - is running, at most `SETTLE_S`,
sleeping between looks so that a thread waiting for the GIL can take it, finish and let go. A
native thread holds HEAD_LOCK only while it runs between its lock and unlock, and then waits for
the GIL, which the forking thread keeps until the fork: once none runs, none holds it. (A
collective still in flight at the fork - an async op not yet waited for - could complete after
the look; a DataLoader forks its workers as an epoch starts, between steps.) A look reads
/proc/self/task, one small file a thread (0.03-0.05 ms for 2-3 threads here). What a fork waits
for is mostly OpenMP's team, which spins before it sleeps: right after a matmul on 2 threads, 7.6
ms (0.07 ms on one), once per burst of forks, since the team sleeps by the next (2-core VM, quiet).
A Python that carries the fix, or a host without /proc, gets no hook.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

SETTLE_S = 0.25  # the longest a fork waits: a native thread that runs for longer computes (a collective in flight)
_POLL_S = 0.0002
_TASKS = Path("/proc/self/task")
_installed = False


def needed(version: tuple[int, ...] = tuple(sys.version_info[:2])) -> bool:
    """Whether this Python's child of a fork may delete thread states under a lock it has not re-made
    (before 3.12; the later 3.11 releases carry a backport, but the hook costs little)."""
    return version < (3, 12)


def running_native_threads() -> list[int]:
    """The ids of this process's threads that `threading` did not start and that are running now."""
    # A native thread that once ran Python code is in threading's table as a _DummyThread: still native.
    python = {thread.native_id for thread in threading.enumerate() if not isinstance(thread, threading._DummyThread)}
    running = []
    for task in _TASKS.iterdir():
        tid = int(task.name)
        if tid in python:
            continue
        try:
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):  # the thread ended meanwhile
            continue
        if state == "R":
            running.append(tid)
    return running


def settle_native_threads(timeout_s: float = SETTLE_S) -> bool:
    """Wait until no native thread runs, at most `timeout_s`; whether none did at the end."""
    deadline = time.monotonic() + timeout_s
    while running_native_threads():
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)  # releases the GIL: a thread waiting for it takes it and finishes
    return True


def guard_forks() -> None:
    """Register `settle_native_threads` to run before each fork of this process (once; only where needed)."""
    global _installed
    if _installed or not needed() or not _TASKS.is_dir():
        return
    os.register_at_fork(before=settle_native_threads)
    _installed = True


def installed() -> bool:
    """Whether this process's forks wait for its native threads (`guard_forks` ran here, or in the
    process this one was forked from)."""
    return _installed
