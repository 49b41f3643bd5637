"""A worker killed mid-epoch of a model-parallel split stops the run in one line, never a hang.

A pipeline stage or a channel shard that dies leaves its neighbours blocked in a point-to-point
receive; the launcher must notice the death and take everyone down fast, naming the rank.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.distributed.test_faults import _alive, _wait_for, _workers

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("split, victim", [("layers", 0), ("channels", 1)])
def test_a_killed_split_worker_ends_the_run_in_one_line(tmp_path, split, victim):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "phalanx", "train", "--devices", "cpu:2", "--split", split,
                             "--dataset", "synthetic", "--epochs", "200", "--no-progress", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        workers = _workers(proc.pid, 2)
        _wait_for(out / "metrics.jsonl", timeout_s=240)  # epoch 1 is done: the pipeline is running
        os.kill(workers[victim], signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = proc.communicate(timeout=90)
        elapsed_s = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, stderr[-2000:]
    assert elapsed_s < 30, f"took {elapsed_s:.1f} s to stop"
    first = stderr.strip().splitlines()[0]
    assert f"worker rank {victim} failed: died (signal SIGKILL) after step" in first, stderr[-2000:]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in workers), "a worker outlived the run"
