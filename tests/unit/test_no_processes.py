"""The unit tier's guard (tests/unit/conftest.py): each way of starting a process fails the test,
naming the call."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import subprocess

import pytest

REFUSED = r"^tests/unit starts no processes, and this test called {}; a test that needs a child process belongs in "


def _refused(call: str):
    return pytest.raises(pytest.fail.Exception, match=REFUSED.format(call))


def test_subprocess_and_what_runs_through_it_are_refused():
    with _refused(r"subprocess\.Popen\(\['true'\]\)"):
        subprocess.run(["true"], timeout=10)
    with _refused(r"subprocess\.Popen\('true'\)"):
        os.popen("true")
    with _refused(r"os\.system"):
        os.system("true")


def test_multiprocessing_is_refused_in_each_start_method():
    for method in multiprocessing.get_all_start_methods():
        process = multiprocessing.get_context(method).Process(target=print)
        with _refused(r"multiprocessing\.process\.BaseProcess\.start"):
            process.start()


def _fork_is_refused() -> None:
    with _refused(r"os\.fork"):
        if os.fork() == 0:  # the guard failed and this is the child: leave at once
            os._exit(0)


def test_fork_and_posix_spawn_are_refused():
    _fork_is_refused()
    with _refused(r"os\.posix_spawn"):
        os.posix_spawn("/bin/true", ["true"], os.environ)


def test_a_spawn_start_below_multiprocessing_is_refused():
    from multiprocessing import util

    with _refused(r"_posixsubprocess\.fork_exec"):
        util.spawnv_passfds("/bin/true", ["true"], [])


def test_a_tests_own_monkeypatch_undo_leaves_the_guard_on(monkeypatch):
    monkeypatch.setattr(os, "getpid", lambda: 1)
    monkeypatch.undo()  # undoes this test's own patches only
    _fork_is_refused()


def test_a_pickled_reference_keeps_its_real_name_and_calling_it_is_refused():
    # An attacker's pickle in a test (test_checkpoint.py's) names os.system; it must still save.
    data = pickle.dumps(os.system)
    assert b"system" in data and b"refused" not in data
    with _refused(r"os\.system"):
        pickle.loads(data)("true")
