"""The fork server's choices, without starting it (tests/distributed/test_fork_server.py starts it):
when a launch forks from it and when it spawns, and what a copy takes on of the launcher's."""

import os
import resource
import sys

import pytest

from phalanx.runtime import fork_server
from phalanx.runtime.fork_server import LauncherState


@pytest.mark.skipif(sys.platform != "linux", reason="the fork server is used on Linux only")
def test_a_launch_forks_from_the_server_until_a_variable_read_at_start_changes(monkeypatch):
    monkeypatch.setattr(fork_server, "_started_with", None)
    assert fork_server.start_method() == "forkserver"  # not started yet: it will start with today's
    monkeypatch.setattr(fork_server, "_started_with", fork_server._at_start_variables())
    assert fork_server.start_method() == "forkserver"
    monkeypatch.setenv("PHALANX_UNRELATED_MARK", "1")  # read after the start: the copy takes it on
    assert fork_server.start_method() == "forkserver"
    for name in ("OMP_SCHEDULE", "LD_PRELOAD", "PYTHONHASHSEED", "MALLOC_ARENA_MAX"):
        with monkeypatch.context() as changed:
            changed.setenv(name, "7")
            assert fork_server.start_method() == "spawn", name


def test_spawn_where_there_is_no_fork_server(monkeypatch):
    monkeypatch.setattr(fork_server.sys, "platform", "darwin")
    assert fork_server.start_method() == "spawn"


def test_the_hash_seed_the_server_starts_with_is_the_one_spawned_workers_get(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    drawn = fork_server._at_start_variables()["PYTHONHASHSEED"]
    assert drawn == fork_server._at_start_variables()["PYTHONHASHSEED"] and "PYTHONHASHSEED" not in os.environ
    monkeypatch.setenv("PYTHONHASHSEED", "3")
    assert fork_server._at_start_variables()["PYTHONHASHSEED"] == "3"


def test_the_launcher_state_is_what_a_spawned_worker_would_inherit(monkeypatch):
    monkeypatch.setenv("PHALANX_UNRELATED_MARK", "here")
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    old_umask = os.umask(0o027)
    try:
        state = LauncherState.capture()
    finally:
        os.umask(old_umask)
    assert state.umask == 0o027 and os.umask(old_umask) == old_umask
    assert state.environ["PHALANX_UNRELATED_MARK"] == "here" and "PYTHONHASHSEED" in state.environ
    assert "PYTHONHASHSEED" not in os.environ  # drawn for the workers, not set here
    assert state.limits[resource.RLIMIT_NOFILE] == resource.getrlimit(resource.RLIMIT_NOFILE)
    if hasattr(os, "sched_getaffinity"):
        assert state.cores == os.sched_getaffinity(0)
    assert [stream.fd for stream in state.streams] == [0, 1, 2]


def test_a_stream_closed_in_the_launcher_is_closed_in_the_copy(tmp_path):
    read_end, write_end = os.pipe()
    os.close(write_end)
    rebuild, args = fork_server._Stream(write_end).__reduce__()
    assert args == (write_end, None)  # nothing to send: the copy closes its own
    os.close(read_end)
