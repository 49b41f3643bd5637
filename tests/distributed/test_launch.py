"""The launcher's failure contract beyond the harness's: no child outlives a failed run (even one
that ignores SIGTERM), nor anything a worker started (its process group goes with it, as under
torchrun), a worker's UsageError stays one line, an unpicklable result or a killed
worker is reported by rank, and the in-process paths (one device, torchrun) spawn nothing and
set the allocator as a spawned worker gets it (checked in fresh interpreters).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from phalanx.runtime.devices import parse_devices
from phalanx.errors import UsageError
from phalanx.runtime.launch import LaunchSpec, WorkerFailed, launch
from phalanx.runtime.procs import process_alive
from tests.distributed.allocator_probe import keeps_large_blocks_off_mmap
from tests.distributed.sockets import listening_addresses


def _spec(world_size: int, **overrides) -> LaunchSpec:
    fields = dict(plan=parse_devices(f"cpu:{world_size}", cuda_count=0), threads_per_device=1, timeout_s=30.0,
                  deadline_s=60.0)
    return LaunchSpec(**{**fields, **overrides})


def record_pid_then_fail(world, pid_dir):
    (pid_dir / f"{world.rank}.pid").write_text(str(os.getpid()))
    dist.barrier()  # both pids are on disk before anyone fails
    if world.rank == 0:
        raise ValueError("rank 0 gives up")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL can stop this one
    time.sleep(3600)


def start_a_child(world, pid_dir, fail: bool):
    """Start a process that would sleep for 10 minutes (as a DataLoader worker or a script's own
    helper would outlive a rank that died), then fail on rank 0 or return."""
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                              "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    (pid_dir / f"child{world.rank}.pid").write_text(str(child.pid))
    dist.barrier()
    if fail and world.rank == 0:
        raise ValueError("rank 0 gives up")
    dist.barrier()


@pytest.mark.distributed
@pytest.mark.parametrize("fail", [True, False])
def test_what_a_worker_started_ends_with_the_run(tmp_path, fail):
    # A worker's children (DataLoader workers, a resource tracker) end with the run, failed or not,
    # instead of running on, reparented to init.
    if fail:
        with pytest.raises(WorkerFailed, match="rank 0 gives up"):
            launch(start_a_child, tmp_path, fail, spec=_spec(2))
    else:
        launch(start_a_child, tmp_path, fail, spec=_spec(2))
    children = [int((tmp_path / f"child{rank}.pid").read_text()) for rank in range(2)]
    deadline = time.monotonic() + 5
    while any(process_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(process_alive(pid) for pid in children), "a child of a worker outlived the run"


def unpicklable_or_killed(world):
    dist.barrier()  # both ranks are past start-up, so rank 0's only error is its result
    if world.rank == 0:
        return threading.Lock()
    os.kill(os.getpid(), signal.SIGKILL)


def usage_error_on_rank_1(world):
    if world.rank == 1:
        raise UsageError("--thing 3 is too big; use --thing 2")
    dist.barrier()  # fails once rank 1 is gone: a secondary error the user must not see


@pytest.mark.distributed
def test_no_child_survives_a_failure(tmp_path):
    with pytest.raises(WorkerFailed) as failure:
        launch(record_pid_then_fail, tmp_path, spec=_spec(2))
    assert str(failure.value).splitlines()[0] == "worker rank 0 failed: ValueError: rank 0 gives up"
    pids = [int((tmp_path / f"{rank}.pid").read_text()) for rank in range(2)]
    for pid in pids:
        with pytest.raises(ProcessLookupError):  # reaped, not a zombie
            os.kill(pid, 0)


@pytest.mark.distributed
def test_unpicklable_result_and_killed_worker_are_reported():
    with pytest.raises(WorkerFailed) as failure:
        launch(unpicklable_or_killed, spec=_spec(2))
    message = str(failure.value)
    assert "--- rank 0 ---" in message and "cannot pickle" in message
    assert message.startswith("worker rank 1 failed: died (signal SIGKILL)")
    assert "--- rank 1 ---" not in message  # a death has no traceback: its line is not said twice


def fail_while_rank_1_sits_stopped(world):
    dist.barrier()
    if world.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # a debugger, Ctrl-Z: it can send no report until continued
    raise ValueError(f"rank {world.rank} gives up")


@pytest.mark.distributed
def test_the_launcher_awaits_no_report_from_a_stopped_worker(monkeypatch):
    # After a first failure the launcher gives the others a grace to report; a worker sitting
    # stopped cannot, so the run ends at once (the grace is an hour here: waiting it out would fail).
    from phalanx.runtime import supervise

    monkeypatch.setattr(supervise, "ERROR_GRACE_S", 3600.0)
    started = time.monotonic()
    with pytest.raises(WorkerFailed, match="worker rank 0 failed: ValueError: rank 0 gives up"):
        launch(fail_while_rank_1_sits_stopped, spec=_spec(2))
    assert time.monotonic() - started < 30


@pytest.mark.distributed
def test_worker_usage_error_is_one_line():
    with pytest.raises(UsageError) as failure:
        launch(usage_error_on_rank_1, spec=_spec(2))
    assert str(failure.value) == "--thing 3 is too big; use --thing 2"


def where_am_i(world, tag):
    return tag, os.getpid(), world.rank, world.world_size, world.backend


def test_one_device_and_torchrun_run_in_process(monkeypatch):
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)  # keep this test process's threads
    assert launch(where_am_i, "solo", spec=_spec(1)) == [("solo", os.getpid(), 0, 1, "none")]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")  # torchrun decides the world, whatever the plan says
    assert launch(where_am_i, "torchrun", spec=_spec(2)) == [("torchrun", os.getpid(), 0, 1, "none")]


def test_spec_validates_itself():
    plan = parse_devices("cpu:2", cuda_count=0)
    with pytest.raises(ValueError, match="deadline_s 0"):
        LaunchSpec(plan=plan, deadline_s=0)
    with pytest.raises(ValueError, match="threads_per_device 0"):
        LaunchSpec(plan=plan, threads_per_device=0)
    with pytest.raises(ValueError, match="timeout_s -1"):
        LaunchSpec(plan=plan, timeout_s=-1)


def listening_addresses_after_a_collective(world):
    dist.barrier()
    dist.all_reduce(__import__("torch").ones(4))
    return listening_addresses()  # this worker's own


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux /proc")
def test_a_local_run_listens_on_loopback_only_and_cleans_up(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the rendezvous dir goes
    results = launch(listening_addresses_after_a_collective, spec=_spec(3))
    loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1 in /proc's hex
    for rank, addresses in enumerate(results):
        assert addresses, f"rank {rank} listens on nothing? (gloo's pairs should show)"
        assert set(addresses) <= loopback, f"rank {rank} listens on {addresses}"
    assert list(tmp_path.iterdir()) == []  # the rendezvous directory is gone


def report_pid_and_allocator(world):
    return os.getpid(), keeps_large_blocks_off_mmap(), world.world_size


def test_spawn_single_runs_one_device_in_a_set_up_worker():
    in_process = launch(report_pid_and_allocator, spec=_spec(1))
    spawned = launch(report_pid_and_allocator, spec=_spec(1, spawn_single=True))
    assert in_process[0][0] == os.getpid()
    pid, allocator, world_size = spawned[0]
    assert pid != os.getpid() and allocator is True and world_size == 1


def report_placement(world):
    import torch
    return sorted(os.sched_getaffinity(0)), torch.get_num_threads()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and at least 2 cores")
def test_bind_cores_pins_each_worker_to_its_own_cores():
    from phalanx.runtime.binding import allowed_cores
    cores = allowed_cores()
    placed = launch(report_placement, spec=_spec(2, threads_per_device=None, bind_cores=True))
    per = len(cores) // 2
    assert [sorted(mine) for mine, _ in placed] == [sorted(cores[:per]), sorted(cores[per:2 * per])]
    assert [threads for _, threads in placed] == [per, per]  # one thread per core of its share
    unbound = launch(report_placement, spec=_spec(2))
    assert all(mine == sorted(os.sched_getaffinity(0)) for mine, _ in unbound)  # opt-in: default leaves them be


MMAPPED_BYTES = """
import ctypes, sys, torch
from phalanx.runtime.binding import keep_freed_memory_mapped
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks "
                                                "fordblks keepcost").split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
if sys.argv[1] == "tuned":
    assert keep_freed_memory_mapped()
before = libc.mallinfo2().hblkhd
x = torch.empty(64 << 20, dtype=torch.uint8)
print(libc.mallinfo2().hblkhd - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")
def test_in_process_workers_keep_large_blocks_off_mmap():
    # One device runs in the launcher's process and torchrun starts its own workers: neither gets
    # launch's allocator env, so place_worker sets the same through mallopt (seen: 0.7 -> 0.5 s/epoch).
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    mapped = {mode: int(subprocess.run([sys.executable, "-c", MMAPPED_BYTES, mode], capture_output=True, text=True,
                                       env=env, check=True, timeout=120).stdout) for mode in ("default", "tuned")}
    if mapped["default"] < 64 << 20:
        pytest.skip("this C library does not mmap a 64 MB block by default")
    assert mapped["tuned"] == 0
