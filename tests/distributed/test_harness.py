"""The worker harness (and through it the launcher): results come back by rank, the known
exit-time gloo abort is tolerated, and a worker that raises, dies or hangs fails the test fast
with every child killed.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import resource
import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed.allocator_probe import keeps_large_blocks_off_mmap
from tests.distributed.harness import WorkersFailed, run_workers

pytestmark = pytest.mark.distributed


def _abort_without_core_dump() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.abort()


def report_then_abort_at_exit(world, offset):
    """Rank 1 imitates gloo's exit-time abort: SIGABRT after its result was delivered."""
    if world.rank == 1:
        atexit.register(_abort_without_core_dump)
    total = torch.tensor([float(world.rank)])
    dist.all_reduce(total)
    env = {key: os.environ.get(key) for key in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")}
    return world.rank + offset, world.world_size, total, torch.get_num_threads(), env, keeps_large_blocks_off_mmap()


def raise_or_die(world):
    if world.rank == 0:
        raise ValueError("boom from rank 0")
    os._exit(3)  # dies without a result or a traceback


def hang(world):
    if world.rank == 0:
        dist.recv(torch.zeros(1), src=1)  # never sent
    else:
        time.sleep(3600)


def test_results_by_rank_and_exit_time_abort_tolerated(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "65536")  # the user's own allocator setting (glibc's default) must win
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    with pytest.warns(UserWarning, match="rank 1 aborted"):
        results = run_workers(report_then_abort_at_exit, 2, 10)
    assert [r[:2] for r in results] == [(10, 2), (11, 2)]
    assert all(torch.equal(r[2], torch.tensor([1.0])) for r in results)
    assert [r[3] for r in results] == [1, 1]  # one thread per worker
    # The user's setting reaches the workers as it is, and phalanx's own (mallopt) stays out of its way.
    assert all(r[4] == {"MALLOC_MMAP_MAX_": "65536", "MALLOC_TRIM_THRESHOLD_": None} for r in results)
    assert [r[5] for r in results] == [False, False]  # glibc still maps large blocks, as the user asked
    assert "MALLOC_TRIM_THRESHOLD_" not in os.environ  # the parent's environment is left alone


def test_raising_or_dying_worker_fails_with_its_traceback():
    with pytest.raises(WorkersFailed) as failure:
        run_workers(raise_or_die, 2, timeout_s=60)
    message = str(failure.value)
    first_line = message.splitlines()[0]
    assert first_line.startswith("raise_or_die on 2 workers: worker rank ")
    assert ("rank 0 failed: ValueError: boom from rank 0" in first_line
            or "rank 1 failed: exited with code 3 without a result" in first_line), first_line
    assert "--- rank 0 ---\nTraceback" in message and "ValueError: boom from rank 0" in message
    assert "exited with code 3 without a result" in message  # the first line's, or rank 1's own section
    assert not mp.active_children()


def test_hung_worker_is_killed_at_deadline():
    started = time.monotonic()
    with pytest.raises(WorkersFailed, match="worker rank 0 failed: gave no result within the 8 s deadline"):
        run_workers(hang, 2, timeout_s=8)
    assert time.monotonic() - started < 20
    assert not mp.active_children()
