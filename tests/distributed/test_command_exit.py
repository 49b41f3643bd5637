"""How the `phalanx` command ends (phalanx/__main__.py `console`): its exit code, its threads joined
and its atexit handlers run as at any exit, but none of the modules' teardown, except in a torchrun
worker, where `phalanx run` runs the user's script and the teardown flushes what it left open."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.distributed

# The command as its console script runs it, in a process that also holds what an exit shows: an
# atexit handler, a non-daemon thread still printing, and an object whose __del__ only the teardown of
# the module's globals calls. `train --epochs 0` ends in bad input (exit 2) before any worker starts.
_COMMAND = textwrap.dedent("""
    import atexit, sys, threading, time
    import phalanx.__main__
    class Torn:
        def __del__(self):
            print("teardown ran", flush=True)
    torn = Torn()
    atexit.register(lambda: print("atexit ran", flush=True))
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread ended", flush=True))).start()
    sys.argv = ["phalanx", "train", "--epochs", "0"]
    phalanx.__main__.console()
""")


def _run(env_extra: dict) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE")}
    return subprocess.run([sys.executable, "-c", _COMMAND], capture_output=True, text=True, timeout=120,
                          env={**env, **env_extra})


def test_the_command_ends_after_its_threads_and_atexit_handlers_without_the_teardown():
    proc = _run({})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "phalanx: error: --epochs 0 must be at least 1"
    assert proc.stdout.splitlines() == ["thread ended", "atexit ran"], proc.stdout


def test_a_torchrun_worker_ends_as_python_does():
    proc = _run({"RANK": "0", "WORLD_SIZE": "1"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout.splitlines() == ["thread ended", "atexit ran", "teardown ran"], proc.stdout
