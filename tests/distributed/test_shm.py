"""The shm allreduce under faults, and its segments' life: private, never left behind.

Correctness against `dist.all_reduce` lives with the other algorithms in test_comm_allreduce.py.
Here: a peer that dies or never arrives ends the wait naming it; a worker SIGKILLed inside an
allreduce takes the run down within seconds; the launcher stopped with SIGTERM (what `timeout`,
schedulers and container stops send) or killed outright takes its workers with it; and after a
normal exit, Ctrl-C, a failed run, a killed worker or a stopped launcher no segment of the run
is left in /dev/shm. Segments are matched by the pid of the rank that made them, so runs of
other tests on the same host cannot confuse these checks.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch

from phalanx.comm import ShmError, ShmGroup
from phalanx.comm.shm import NAME_PREFIX, SHM_DIR, create_segment, shm_supported
from tests.distributed.harness import WorkersFailed, run_workers
from tests.distributed.test_faults import _alive, _workers

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(shm_supported() is not None, reason=f"no shm allreduce here: {shm_supported()}")]

PHALANX = [sys.executable, "-m", "phalanx"]


def _segments_of(pids) -> list[str]:
    prefixes = tuple(f"{NAME_PREFIX}{pid}-" for pid in pids)
    return [n for n in os.listdir(SHM_DIR) if n.startswith(prefixes)]


def test_a_segment_is_private_and_its_name_never_reused(tmp_path):
    path = os.path.join(SHM_DIR, f"{NAME_PREFIX}{os.getpid()}-test")
    old_umask = os.umask(0)  # even a permissive umask must not widen it
    try:
        mapping, error = create_segment(path, 1 << 16)
        assert error is None and mapping is not None
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        again, error = create_segment(path, 1 << 16)  # O_EXCL: a second run never shares it
        assert again is None and "cannot create" in error
        mapping.close()
    finally:
        os.umask(old_umask)
        os.unlink(path)


def _dead_peer(world) -> str:
    group = ShmGroup(world=world)
    if world.rank == 1:
        time.sleep(30)  # never arrives; rank 0 is told rank 1's pid is a dead process's
        return "slept"
    child = subprocess.Popen(["true"])
    child.wait()
    group._pids_view[1] = child.pid  # reaped: a pid that no longer exists
    group.allreduce(torch.ones(8))  # raises ShmError naming rank 1
    return "no error"


def test_a_dead_peer_is_named_within_a_second():
    started = time.monotonic()
    with pytest.raises(WorkersFailed) as info:  # rank 1 is taken down once rank 0 has failed
        run_workers(_dead_peer, 2, timeout_s=60)
    assert time.monotonic() - started < 20  # start-up, 0.5 s to notice, teardown; not rank 1's 30 s
    first = str(info.value).splitlines()[0]
    assert "worker rank 0 failed: ShmPeerGone: shm allreduce: rank 1 (pid" in first, str(info.value)[-2000:]
    assert "died while rank 0 waited for it" in first


def _finished_peer(world) -> str:
    from phalanx.comm.calls import enter
    from phalanx.runtime.board import COMM, FINISHED, mark_exit, open_board
    from phalanx.runtime.tags import Tag

    world = open_board(world)
    group = ShmGroup(world=world)
    if world.rank == 1:
        mark_exit(world, ok=True)  # its work returned; it exits before rank 0's first look
        time.sleep(30)
        return "slept"
    deadline = time.monotonic() + 20
    while world.board.line(1).state != FINISHED and time.monotonic() < deadline:
        time.sleep(0.01)
    child = subprocess.Popen(["true"])
    child.wait()
    group._pids_view[1] = child.pid  # gone, as a process that exited after finishing is
    group.allreduce(torch.ones(8), ticket=enter(world, COMM, Tag("gradient", 0, step=3), 32))
    return "no error"


def test_a_peer_that_finished_and_exited_is_named_as_finished_not_dead():
    """The exit can beat the waiter's first look: the board's word decides, not the missing pid."""
    with pytest.raises(WorkersFailed) as info:
        run_workers(_finished_peer, 2, timeout_s=60)
    first = str(info.value).splitlines()[0]
    assert "rank 1 finished its work normally while rank 0 waits for it in step 4's gradient bucket 0" in first, \
        str(info.value)[-2000:]
    assert "died" not in first


def _late_peer(world) -> str:
    group = ShmGroup(world=world)
    group.timeout_s = 1.0
    if world.rank == 1:
        time.sleep(30)
        return "slept"
    group.allreduce(torch.ones(8))  # raises ShmError naming rank 1 after 1 s
    return "no error"


def test_a_peer_that_never_arrives_fails_at_the_timeout():
    with pytest.raises(WorkersFailed) as info:
        run_workers(_late_peer, 2, timeout_s=60)
    assert "rank 1 did not arrive within the 1 s timeout" in str(info.value)


def _full_dev_shm(world) -> dict:
    import phalanx.comm.shm as shm
    from phalanx.models import LeNet
    from phalanx.data_parallel import DataParallel, DataParallelConfig

    shm.create_segment = lambda path, size: (None, "cannot reserve 9.0 MiB in /dev/shm (No space left on device)")
    with DataParallel(LeNet(), world=world) as dp:  # auto: falls back, on every rank alike
        dp.zero_grad(set_to_none=False)  # every gradient a zeroed bucket slot (None until then, as on one device)
        for p in dp.module.parameters():
            p.grad.fill_(world.rank + 1.0)
        dp.finish_gradient_sync()
        summed = dp.buckets[0].buffer.clone()
        result = {"algorithm": dp.algorithm, "reason": dp.fallback_reason, "sum": float(summed[0])}
    try:
        DataParallel(LeNet(), world=world, options=DataParallelConfig(allreduce="shm"))  # named explicitly: no fallback
    except ShmError as exc:
        result["explicit"] = str(exc)
    return result


def test_auto_falls_back_to_native_when_no_segment_can_be_made_and_explicit_shm_refuses():
    for rank, result in enumerate(run_workers(_full_dev_shm, 2, timeout_s=90)):
        assert result["algorithm"] == "native" and "No space left on device" in result["reason"], rank
        assert result["sum"] == 3.0  # 1 + 2: the exchange still works
        assert "shared-memory segment unusable on rank 0" in result["explicit"]
        assert result["explicit"].endswith("use --allreduce native")


def _kill_inside_allreduce(world) -> int:
    group = ShmGroup(world=world)
    tensor = torch.ones(1 << 18)  # 1 MB: several rounds, the chunked path
    for call in range(1_000_000):
        if world.rank == 1 and call == 20:
            os.kill(os.getpid(), signal.SIGKILL)  # rank 0 is already inside this call
        group.allreduce(tensor)
        tensor.fill_(1.0)
    return call


def test_a_worker_killed_inside_an_allreduce_stops_the_run_fast():
    started = time.monotonic()
    with pytest.raises(WorkersFailed) as info:
        run_workers(_kill_inside_allreduce, 3, timeout_s=60)
    assert time.monotonic() - started < 30
    first = str(info.value).splitlines()[0]
    assert "worker rank 1 failed: died (signal SIGKILL)" in first, str(info.value)[-2000:]


def _train(tmp_path, *extra) -> subprocess.Popen:
    return subprocess.Popen([*PHALANX, "train", "--devices", "cpu:2", "--dataset", "synthetic", "--no-progress",
                             "--out", str(tmp_path / "run"), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _under_way(proc, tmp_path) -> list[int]:
    workers = _workers(proc.pid, 2)
    deadline = time.monotonic() + 120
    while not (tmp_path / "run" / "metrics.jsonl").exists():  # epoch 1 done: shm is in use
        assert time.monotonic() < deadline and proc.poll() is None, "training never got under way"
        time.sleep(0.05)
    return workers


def _assert_gone(workers, within_s=30.0):
    deadline = time.monotonic() + within_s
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in workers), "a worker outlived its launcher"
    assert _segments_of(workers) == []


def test_a_normal_run_uses_shm_and_leaves_no_segment(tmp_path):
    proc = _train(tmp_path, "--epochs", "1")
    workers = _workers(proc.pid, 2)
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr[-2000:]
    assert "allreduce shm (auto" in stdout
    _assert_gone(workers)


@pytest.mark.parametrize("how, code", [("SIGTERM", 143), ("SIGINT", 130), ("SIGKILL", -9), ("worker", 1)])
def test_a_stopped_launcher_or_killed_worker_leaves_no_worker_and_no_segment(tmp_path, how, code):
    proc = _train(tmp_path, "--epochs", "200")
    try:
        workers = _under_way(proc, tmp_path)
        stopped_at = time.monotonic()
        if how == "SIGINT":
            os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C goes to the whole group
        elif how == "worker":
            os.kill(workers[1], signal.SIGKILL)
        else:
            os.kill(proc.pid, getattr(signal, how))  # the launcher alone, as `timeout` does
        _, stderr = proc.communicate(timeout=60)
        assert time.monotonic() - stopped_at < 30
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == code, stderr[-2000:]
    if how == "SIGTERM":  # with --out, saved where it stopped (tests/distributed/test_stop_saves.py)
        assert stderr.strip().splitlines()[-1].startswith("phalanx: stopped by SIGTERM after epoch "), stderr[-2000:]
    _assert_gone(workers)
