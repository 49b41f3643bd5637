"""The unit tier's rule, enforced: a unit test starts no process.

For each unit test, every way Python starts a process fails the test that tries, naming the call:
subprocess (and `os.popen` through it), `os.system`, `os.fork`/`forkpty`/`posix_spawn`, and
multiprocessing's process start (what `torch.multiprocessing.spawn` and a DataLoader's workers
use); a spawn or forkserver start's `fork_exec` is caught too. The failure is pytest's own
outcome, not an exception, so code that catches `Exception` around a child cannot hide it. A test
that needs a child process belongs in tests/distributed (docs/tests.md says what goes where).
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess

import pytest

try:
    import _posixsubprocess  # multiprocessing's spawn and forkserver start through its fork_exec
except ImportError:  # not a POSIX system
    _posixsubprocess = None


# matplotlib builds its font cache on first import where it has none (a fresh install, an empty
# $XDG_CACHE_HOME), running `fc-list`: the machine's set-up, not a test's, so it happens here, as
# this file is collected, before the rule below is on for any test that draws a PNG.
from matplotlib import font_manager  # noqa: E402,F401  (the import builds and saves the cache)

RULE = ("tests/unit starts no processes, and this test called {call}; a test that needs a child process "
        "belongs in tests/distributed (docs/tests.md)")


def _refuse(module: str, qualname: str):
    """A stand-in for `module.qualname` that fails the test; it carries the real name, so pickling
    a reference to the function (an attacker's payload in a test) still writes that name."""
    def refused(*args, **kwargs):
        shown = f"subprocess.Popen({args[1]!r})" if qualname == "Popen._execute_child" else f"{module}.{qualname}"
        pytest.fail(RULE.format(call=shown), pytrace=True)
    refused.__module__, refused.__qualname__, refused.__name__ = module, qualname, qualname.rsplit(".", 1)[-1]
    return refused


@pytest.fixture(autouse=True)
def no_processes():
    """Make starting a process fail the test, for the test's duration (its own monkeypatch may undo)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "_execute_child", _refuse("subprocess", "Popen._execute_child"))
        patch.setattr(multiprocessing.process.BaseProcess, "start",
                      _refuse("multiprocessing.process", "BaseProcess.start"))
        if _posixsubprocess is not None:
            patch.setattr(_posixsubprocess, "fork_exec", _refuse("_posixsubprocess", "fork_exec"))
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            if hasattr(os, name):
                patch.setattr(os, name, _refuse("os", name))
        yield
