"""A script's own rendezvous under phalanx run (runtime/own_rendezvous.py), in this process with a
store of the test's as the launcher's: MASTER_PORT set by the script and a tcp:// init_method join
that store, said once on rank 0 at the script's line, the script's environment kept; a store=, a
file:// rendezvous and the launcher's own port pass through unsaid, and torch's function is put back;
another world size or rank than the launcher's is refused in one line before any wait.
End to end on 2 workers: tests/distributed/test_own_rendezvous.py."""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import warnings

import pytest
import torch.distributed as dist

from phalanx.errors import PhalanxWarning, UsageError
from phalanx.runtime.own_rendezvous import joining_launcher_store, launcher_store_env
from phalanx.runtime.world import launcher_env


@pytest.fixture
def launcher(monkeypatch):
    """A store as phalanx run's launcher hosts it, and a worker's environment pointing at it (rank 0 of 1)."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "RANK": "0", "WORLD_SIZE": "1",
                        "LOCAL_RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True",
                        "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(name, value)
    yield store


def _free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


@contextlib.contextmanager
def _said(rank: int = 0):
    with warnings.catch_warnings(record=True) as caught, joining_launcher_store(rank=rank, world_size=1):
        warnings.simplefilter("always")
        yield caught
    caught[:] = [w for w in caught if issubclass(w.category, PhalanxWarning)]


def _joined(**kwargs) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10), **kwargs)  # the script's line
    try:
        assert dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()


def test_the_scripts_master_port_joins_the_launchers_store_said_once_and_kept_in_its_environment(launcher):
    elsewhere = _free_port()  # no one listens there: without the hold the group waited its whole timeout
    with _said() as caught:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "localhost", elsewhere
        _joined()
        _joined()
        assert os.environ["MASTER_PORT"] == elsewhere
    (said,) = caught
    assert str(said.message).startswith(f"the script's process group meets at localhost:{elsewhere} (MASTER_ADDR and "
                                        "MASTER_PORT set by the script), where under phalanx run and torchrun no")
    assert f"joined its own store at 127.0.0.1:{launcher.port} instead: drop those lines" in str(said.message)
    assert said.filename == __file__ and "the script's line" in open(__file__).read().splitlines()[said.lineno - 1]


def test_a_tcp_init_method_joins_the_launchers_store(launcher):
    with _said() as caught:
        _joined(init_method=f"tcp://localhost:{_free_port()}", rank=0, world_size=1)
    assert len(caught) == 1 and "(init_method='tcp://localhost:" in str(caught[0].message)
    assert "drop init_method (both launchers set MASTER_ADDR and MASTER_PORT" in str(caught[0].message)


def test_the_launchers_port_a_store_and_other_ranks_pass_unsaid_and_torchs_function_is_put_back(launcher, tmp_path):
    original = dist.init_process_group
    with _said() as caught:
        assert dist.init_process_group is not original
        _joined()  # the launcher's own MASTER_PORT
        _joined(store=dist.HashStore(), rank=0, world_size=1)
        _joined(init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    assert caught == [] and dist.init_process_group is original is dist.distributed_c10d.init_process_group
    with _said(rank=1) as caught:  # rank 1 of the launcher's: not the one to say it
        os.environ["MASTER_PORT"], os.environ["RANK"] = _free_port(), "1"
        moved = launcher_store_env(launcher_env())
    assert caught == [] and moved.master_port == launcher.port and moved.master_addr == "127.0.0.1"


def test_outside_a_launcher_nothing_is_held(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    original = dist.init_process_group
    with joining_launcher_store(rank=0, world_size=1):
        assert dist.init_process_group is original


def test_another_world_size_or_rank_than_the_launchers_is_refused_at_once(launcher):
    with _said(), pytest.raises(UsageError, match=r"^the script opens its process group with world_size=4, and "
                                                  r"phalanx run started 1 workers \(WORLD_SIZE=1\): every rank would "
                                                  r"wait --timeout .* or start as many \(phalanx run --devices 4\)$"):
        dist.init_process_group("gloo", world_size=4, timeout=datetime.timedelta(seconds=30))
    with _said(), pytest.raises(UsageError, match=r"^the script opens its process group with rank=1 on the worker "
                                                  r"whose RANK is 0: two workers would claim rank 1 .* leave rank out "
                                                  r"\(env:// reads RANK\)"):
        dist.init_process_group("gloo", rank=1, world_size=1, timeout=datetime.timedelta(seconds=30))
    assert not dist.is_initialized()


@pytest.mark.parametrize("name, value, said", [
    ("WORLD_SIZE", "4", r'^the script opens its process group after setting os.environ\["WORLD_SIZE"\] = "4", and '
                        r"phalanx run started 1 workers \(WORLD_SIZE=1\): .* drop the line that sets it \(the launcher "
                        r"sets WORLD_SIZE\), or start as many \(phalanx run --devices 4\)$"),
    ("RANK", "1", r'^the script opens its process group after setting os.environ\["RANK"\] = "1" on the worker whose '
                  r"RANK is 0: two workers would claim rank 1 .* drop the line that sets it \(the launcher sets RANK\)$")])
def test_a_world_size_or_rank_the_script_set_in_its_environment_is_refused_at_once(launcher, monkeypatch, name, value,
                                                                                   said):
    # `os.environ["WORLD_SIZE"] = "4"` before an env:// rendezvous or phalanx.init(), which read it: each waited
    # --timeout for ranks that never came, then torch's DistStoreError traceback.
    monkeypatch.setenv(name, value)
    with _said(), pytest.raises(UsageError, match=said):
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    with _said(), pytest.raises(UsageError, match=said):
        launcher_store_env(launcher_env())
    assert not dist.is_initialized()
    with _said() as caught:  # an argument wins over the environment in torch's env://: the launcher's values pass
        _joined(rank=0, world_size=1)
    assert caught == []
