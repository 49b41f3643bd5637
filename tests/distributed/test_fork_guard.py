"""The fork guard (phalanx/runtime/fork_guard.py): a child forked while native threads make
Python thread states, as torch's gloo threads do after each collective, must start.

The reproduction: native threads (pthread_create through ctypes, each running a Python callback,
which ctypes enters with PyGILState_Ensure: a new thread state, under the lock the child of a
fork on CPython < 3.12 takes before re-making it), started right before each fork, as a
collective's completion wakes gloo's threads right before a DataLoader forks its workers. On
this 2-core VM, quiet, 15 of 200 such children hung without the guard (2026-12-05) and none of
2,000 with it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from phalanx.runtime import fork_guard

pytestmark = pytest.mark.distributed

CHURN = textwrap.dedent("""
    import ctypes, os, signal, sys, time
    from phalanx.runtime.fork_guard import guard_forks, installed

    guard_forks()
    libc = ctypes.CDLL(None)
    touch = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(lambda arg: None)
    forks, threads, hung = int(sys.argv[1]), int(sys.argv[2]), 0
    for _ in range(forks):
        tids = [ctypes.c_ulong() for _ in range(threads)]
        for tid in tids:
            assert libc.pthread_create(ctypes.byref(tid), None, touch, None) == 0
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        deadline = time.monotonic() + 2
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:  # stuck inside os.fork(): killed, counted
                hung += 1
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.001)
        for tid in tids:
            libc.pthread_join(tid, None)
    print(installed(), hung)
""")


@pytest.mark.skipif(not fork_guard.needed(), reason="this Python re-makes the lock before it takes it")
def test_children_forked_while_native_threads_make_thread_states_start():
    done = subprocess.run([sys.executable, "-c", CHURN, "150", "32"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "0"], done.stdout
