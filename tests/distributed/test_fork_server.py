"""Workers forked from the fork server (runtime/fork_server.py) are what spawned ones were: they
take on what the launcher holds when they start, not what it held when the server started (its
environment, umask, cores, ulimits and standard streams), and run their exit handlers; a changed
start-up variable gets a new server, and so does a command whose workers train (it imports torch's
compiler front end for them); a SIGTERM to the launcher's whole process group stops them
through the launcher, gently; a SIGKILLed launcher takes the server and every worker with it."""

import contextlib
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from phalanx.runtime import fork_server
from tests.distributed.harness import run_workers
from tests.distributed.test_faults import PHALANX, _alive, _wait_for, _workers, assert_all_gone

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(sys.platform != "linux", reason="the fork server is used on Linux only")]


def _what_it_inherited(world):
    import signal as signals

    import torch

    print(f"rank {world.rank} writes to the launcher's stdout", flush=True)
    umask = os.umask(0)
    os.umask(umask)
    return {"parent": os.getppid(), "mark": os.environ.get("PHALANX_FORK_SERVER_MARK"), "umask": umask,
            "cores": sorted(os.sched_getaffinity(0)), "nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
            "hash": hash("phalanx"), "sigterm_ignored": signals.getsignal(signals.SIGTERM) == signals.SIG_IGN,
            "sum": float(torch.ones(3).sum())}


def test_a_copy_takes_on_what_the_launcher_holds_as_it_starts_not_as_the_server_started(monkeypatch, capfd):
    fork_server.start_early()  # the server exists before any of the changes below
    monkeypatch.setenv("PHALANX_FORK_SERVER_MARK", "set after the server started")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    cores = sorted(os.sched_getaffinity(0))
    old_umask = os.umask(0o027)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft - 1, hard))
    os.sched_setaffinity(0, cores[:1])
    try:
        results = run_workers(_what_it_inherited, 2, timeout_s=60)
    finally:
        os.umask(old_umask)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        os.sched_setaffinity(0, cores)
    for rank, got in enumerate(results):
        assert got["parent"] != os.getpid(), "spawned by the launcher, not forked by the server"
        assert got["parent"] == results[0]["parent"]
        assert got["mark"] == "set after the server started"
        assert got["umask"] == 0o027
        assert got["cores"] == cores[:1]
        assert got["nofile"] == (soft - 1, hard)
        assert not got["sigterm_ignored"]  # the server ignores it; a worker must not
        assert got["sum"] == 3.0
        assert got["hash"] == results[0]["hash"]  # one salt for every rank (hash_seed.py)
    out = capfd.readouterr().out
    assert "rank 0 writes to the launcher's stdout" in out and "rank 1 writes to the launcher's stdout" in out


def _registers_an_exit_handler(world):
    import atexit

    atexit.register(lambda: open(os.path.join(os.environ["PHALANX_EXIT_MARKS"], f"exited-{world.rank}"), "w").close())
    return os.getppid()


def test_a_copy_runs_its_exit_handlers_as_a_spawned_worker_does(monkeypatch, tmp_path):
    """A copy ends through os._exit (multiprocessing's forkserver), which skips atexit: a script's
    handlers that flush a log or close a tracker must run all the same."""
    monkeypatch.setenv("PHALANX_EXIT_MARKS", str(tmp_path))
    parents = run_workers(_registers_an_exit_handler, 2, timeout_s=60)
    assert os.getpid() not in parents, "spawned by the launcher, not forked by the server"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["exited-0", "exited-1"]


def _its_server(world):
    with open(f"/proc/{os.getppid()}/environ", "rb") as environ:  # as the server was started
        started = dict(item.split(b"=", 1) for item in environ.read().split(b"\0") if b"=" in item)
    return {"parent": os.getppid(), "server_schedule": started.get(b"OMP_SCHEDULE", b"").decode(),
            "schedule": os.environ.get("OMP_SCHEDULE")}


def test_a_variable_read_at_start_that_changed_starts_a_new_server_with_it(monkeypatch):
    monkeypatch.delenv("OMP_SCHEDULE", raising=False)
    before = run_workers(_its_server, 2, timeout_s=60)
    monkeypatch.setenv("OMP_SCHEDULE", "static")  # read by libgomp as it loads, in the server's import of torch
    after = run_workers(_its_server, 2, timeout_s=60)
    old, new = before[0]["parent"], after[0]["parent"]
    assert {got["parent"] for got in before} == {old} and {got["parent"] for got in after} == {new}
    assert os.getpid() not in (old, new), "spawned by the launcher, not forked by a server"
    assert new != old and not _alive(old), "the server that started without it was kept"
    assert before[0]["server_schedule"] == "" and all(got["server_schedule"] == "static" for got in after)
    assert all(got["schedule"] == "static" for got in after)


def _compiler_imported(world):
    return os.getppid(), "torch._dynamo" in sys.modules  # on the worker's entry, before any optimizer


def test_a_command_whose_workers_train_gets_a_server_that_imported_torchs_compiler_once():
    """Each worker's first optimizer imported torch._dynamo (2-3 s of a core); for train, verify,
    predict and sweep the server imports it before it forks them, and a launch that wants it
    otherwise than the running server gets a new one."""
    try:
        fork_server.start_early(workers_train=True)
        trains = run_workers(_compiler_imported, 2, timeout_s=60)
        fork_server.start_early(workers_train=False)  # phalanx run's: its script may make no optimizer
        plain = run_workers(_compiler_imported, 2, timeout_s=60)
    finally:
        fork_server.start_early(workers_train=False)
    assert [imported for _, imported in trains] == [True, True], trains
    assert [imported for _, imported in plain] == [False, False], plain
    assert trains[0][0] != plain[0][0] and os.getpid() not in (trains[0][0], plain[0][0])


# Each rank writes its pid once it has joined, then sleeps; a SIGTERM it receives is written down.
SLEEPER = textwrap.dedent("""
    import os, signal, sys, time
    import phalanx
    phalanx.init()
    out = sys.argv[1]
    def stopped(signum, frame):
        open(os.path.join(out, f"stopped-{os.environ['RANK']}"), "w").close()
        raise SystemExit(0)
    signal.signal(signal.SIGTERM, stopped)
    open(os.path.join(out, f"pid-{os.environ['RANK']}.tmp"), "w").write(str(os.getpid()))
    os.replace(os.path.join(out, f"pid-{os.environ['RANK']}.tmp"), os.path.join(out, f"pid-{os.environ['RANK']}"))
    time.sleep(120)
""")


def _start_sleepers(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    proc = subprocess.Popen([*PHALANX, "run", "--devices", "cpu:2", "--threads-per-device", "1", str(script),
                             str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    for rank in (0, 1):
        _wait_for(tmp_path / f"pid-{rank}", timeout_s=120)
    return proc


def test_a_sigterm_to_the_launchers_group_stops_the_workers_through_the_launcher(tmp_path):
    proc = _start_sleepers(tmp_path)
    try:
        workers = _workers(proc.pid, 2)
        servers = {_parent(worker) for worker in workers} - {proc.pid}
        assert len(servers) == 1, "the workers were not forked by one server"
        # What a SIGTERM to the whole group does to the server: nothing (had it died, every
        # worker would have died with it, SIGKILLed, their parent-death signal).
        os.kill(*servers, signal.SIGTERM)
        time.sleep(1.5)
        assert all(_alive(pid) for pid in [*servers, *workers]), "the server or a worker died of its SIGTERM"
        os.killpg(proc.pid, signal.SIGTERM)  # the launcher, its fork server and its resource tracker
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert_all_gone(workers)
    # Forwarded by the launcher: each worker's own handler ran.
    assert (tmp_path / "stopped-0").exists() and (tmp_path / "stopped-1").exists(), stderr[-2000:]


def test_a_sigkilled_launcher_takes_its_fork_server_and_every_worker_with_it(tmp_path):
    proc = _start_sleepers(tmp_path)
    try:
        workers = _workers(proc.pid, 2)
        servers = [pid for pid in {_parent(worker) for worker in workers} if pid != proc.pid]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert_all_gone(workers + servers)
    finally:
        with contextlib.suppress(ProcessLookupError):  # what is left of the group, if anything
            os.killpg(proc.pid, signal.SIGKILL)


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def test_a_fork_server_killed_alone_is_named_as_what_ended_the_workers(tmp_path):
    # The workers die with it (their parent-death signal), and their exit status, which the server
    # carried, with them: multiprocessing reads 255, which said "exited with code 255" for each.
    proc = _start_sleepers(tmp_path)
    try:
        workers = _workers(proc.pid, 2)
        (server,) = {_parent(worker) for worker in workers} - {proc.pid}
        os.kill(server, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    lost = (f"died with the fork server that started the workers (pid {server}), which ended while they ran (killed "
            "from outside?); rerun the command")
    assert proc.returncode == 1
    assert stderr.splitlines()[1:] == [f"phalanx: worker rank 0 failed: {lost}", f"rank 1 failed too: {lost}"], stderr
    assert_all_gone(workers)
