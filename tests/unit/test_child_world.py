"""A process a joined worker started, which inherited the worker's RANK and WORLD_SIZE, is a
world of one in one warning (it tried to join as a second rank and took the run down: found by an
outside-user trial, rank 0 running an evaluation script with subprocess.run); a process started
before any join (a wrapper's child) still joins, and so do the workers of a launcher a worker
starts, and of phalanx's launcher whatever stamp it inherited. tests/distributed/test_child_world.py
runs the first two under `phalanx run`."""

from __future__ import annotations

import os
import warnings

import phalanx
from phalanx.runtime import child_world, script
from phalanx.runtime.world import launcher_env

RUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
       "MASTER_PORT": "1"}  # port 1: a join would fail at once, not pass unnoticed
KEY = "127.0.0.1:1/1"


def test_the_stamp_tells_the_worker_from_its_descendants(monkeypatch):
    monkeypatch.setenv(child_world.JOINED_PID, "")  # what the launcher gives its workers; undone after the test
    assert child_world.joined_worker(KEY) is None  # nobody joined: this process may be the worker
    monkeypatch.delenv(child_world.JOINED_PID)
    assert child_world.joined_worker(KEY) is None
    child_world.stamp_joined(KEY)
    assert os.environ[child_world.JOINED_PID] == f"{os.getpid()}@{KEY}" and child_world.joined_worker(KEY) is None
    monkeypatch.setenv(child_world.JOINED_PID, f"{os.getpid() + 1}@{KEY}")
    assert child_world.joined_worker(KEY) == os.getpid() + 1
    assert child_world.joined_worker("127.0.0.1:2/0") is None  # a launcher between them named another run
    assert child_world.joined_worker("127.0.0.1:1/0") is None  # or another rank
    monkeypatch.setenv(child_world.JOINED_PID, f"not a pid@{KEY}")
    assert child_world.joined_worker(KEY) is None
    for name, value in RUN.items():
        monkeypatch.setenv(name, value)
    assert child_world.run_key(launcher_env()) == KEY


def test_init_in_a_joined_workers_child_is_a_world_of_one_said_once(monkeypatch):
    for name, value in {**RUN, child_world.JOINED_PID: f"1@{KEY}"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(script, "_current", None)
    monkeypatch.setattr(script, "_context", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        world = phalanx.init(device="cpu", timeout_s=3.0)  # the code before: a join that fails in 3 s
    assert (world.rank, world.world_size, world.backend) == (0, 1, "none")
    said = [str(w.message) for w in caught if issubclass(w.category, phalanx.PhalanxWarning)]
    assert len(said) == 1 and caught[0].filename == __file__, said
    assert f"pid {os.getpid()}, a process that worker rank 1 (pid 1) started after it joined the run" in said[0]
    assert "cannot join the run as a second rank 1, so this process is a world of one" in said[0]
    assert os.environ[child_world.JOINED_PID] == f"1@{KEY}"  # a world of one joins nothing: the stamp stays


def test_the_launchers_workers_start_unstamped_whatever_it_inherited(monkeypatch):
    # A stamp in the launcher's own environment (pytest's, after a test left one; a launcher started by
    # a joined worker) made every worker of the run a world of one.
    from phalanx.runtime.launch import torchrun_env

    monkeypatch.setenv(child_world.JOINED_PID, f"1@{KEY}")
    env = torchrun_env(rank=1, world_size=2, master_port=1, run_id="r")
    assert env[child_world.JOINED_PID] == ""
    monkeypatch.setenv(child_world.JOINED_PID, env[child_world.JOINED_PID])  # as the worker's os.environ.update
    assert child_world.joined_worker(KEY) is None
