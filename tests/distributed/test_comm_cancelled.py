"""A collective `AsyncComm.close()` cancels before it ran does not report itself done.

`on_done` tells a trace when a bucket's exchange really ended (`Tracer.comm_done`). Jobs queued
on the communication thread when `close()` stops it are cancelled, and a cancelled future runs its
done-callbacks on the closing thread: on 2 gloo workers, rank 0 launching 3 shm allreduces its
peer never joins, then closing, ran `on_done` for buckets 1 and 2 from the main thread during
close(), so a trace written after it (a script diagnosing a failed run) drew two exchanges that
never ran as completed, ending at close(). Nothing else was harmed: the gradients were untouched
(the sums are written at `wait()` only), and close() did not raise even from a callback that did
(concurrent.futures logs it). Now a cancelled job's `on_done` does not run.

Nor a failed one's: rank 0 launching 3 shm allreduces (2 s timeout) its peer never joins ran
`on_done` for all 3: bucket 0, which stalled and failed (PeerStalled), and buckets 1 and 2, refused
without running ("not run: an earlier collective ... failed"), so a trace drew three finished
exchanges, one 2 s long, and counted them in its bandwidth. Now `on_done` runs only for a
collective that completed (calls.when_completed), as on the caller's thread, where a failure
raised before it.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from phalanx.comm import AsyncComm
from phalanx.runtime.tags import Tag
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed
BUCKETS = 3


def _closed_with_jobs_queued(world) -> dict:
    comm = AsyncComm(world=world, algorithms=("shm",))
    done, grads = [], [torch.ones(1000) for _ in range(BUCKETS)]
    if world.rank == 0:  # rank 1 never joins: the first job waits on the segment, the others queue behind it
        for index, grad in enumerate(grads):
            comm.allreduce_async(grad, algorithm="shm", tag=Tag("gradient", index),
                                 on_done=lambda i=index: done.append(i))
        time.sleep(0.3)
    comm.close()
    return {"done": sorted(done), "untouched": all(bool((grad == 1).all()) for grad in grads)}


def test_jobs_cancelled_at_close_run_no_on_done():
    first, second = run_workers(_closed_with_jobs_queued, 2, timeout_s=120)
    assert first["done"] == []  # 0 aborted while running, 1 and 2 never ran
    assert second == {"done": [], "untouched": True} and first["untouched"]


def _failed_then_refused(world) -> dict:
    """Both ranks: 3 shm and 3 native allreduces that complete; then rank 0 alone 3 shm ones its
    peer never joins (2 s timeout): the first fails, the others are refused."""
    comm = AsyncComm(world=dataclasses.replace(world, timeout_s=2.0), algorithms=("shm",))
    completed, failed, outcomes = [], [], []
    for algorithm in ("shm", "native"):
        handles = [comm.allreduce_async(torch.ones(100), algorithm=algorithm, tag=Tag("gradient", index),
                                        on_done=lambda i=index, a=algorithm: completed.append((a, i)))
                   for index in range(BUCKETS)]
        for handle in handles:
            handle.wait()
    if world.rank == 0:
        handles = [comm.allreduce_async(torch.ones(100), algorithm="shm", tag=Tag("gradient", index, step=2),
                                        on_done=lambda i=index: failed.append(i)) for index in range(BUCKETS)]
        for handle in handles:
            try:
                handle.wait()
                outcomes.append("completed")
            except Exception as exc:  # noqa: BLE001 - what each wait raised is the result
                outcomes.append(type(exc).__name__)
    else:
        time.sleep(4.0)  # outside any collective until rank 0's first has timed out
    comm.close()
    return {"completed": sorted(completed), "failed": failed, "outcomes": outcomes}


def test_a_failed_or_refused_job_runs_no_on_done_and_a_completed_one_does():
    first, second = run_workers(_failed_then_refused, 2, timeout_s=120)
    both = sorted((a, i) for a in ("native", "shm") for i in range(BUCKETS))
    assert first["completed"] == both and second["completed"] == both
    assert first["outcomes"] == ["PeerStalled", "CollectiveAborted", "CollectiveAborted"]
    assert first["failed"] == []
