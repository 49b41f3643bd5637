"""Thread discipline: a CPU worker's intra-op threads are the training thread's team and nothing
else. With OpenMP every thread that runs an ATen op above the parallel grain opens a team of its
own, so a communication thread summing buckets beside backward would grow by as many threads as
the training thread's team does; and torch's second pool (pthreadpool, sized by
torch.set_num_threads) would add as many again, idle. One extra thread per worker is the
training thread's one more team member, nothing else.

The census runs a few overlapped training steps under `phalanx run` (scripts/thread_census.py:
buckets above the grain, exchanged by the shm allreduce on the communication thread) and counts
the worker's OS threads while the communication thread lives."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
CENSUS = REPO / "tests" / "distributed" / "scripts" / "thread_census.py"


def census(tmp_path: Path, threads: int) -> list[dict]:
    out = tmp_path / f"threads{threads}"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", "--threads-per-device",
                           str(threads), "--timeout", "60", "--quiet", str(CENSUS), str(out)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_an_extra_intra_op_thread_adds_one_os_thread_to_a_worker(tmp_path):
    one, three = census(tmp_path, 1), census(tmp_path, 3)
    for a, b in zip(one, three):
        assert (a["algorithm"], b["algorithm"]) == ("shm", "shm")
        assert (a["intra_op_threads"], b["intra_op_threads"]) == (1, 3)
        # 2 more intra-op threads: the training thread's team grows by 2, and nothing else does.
        assert len(b["threads"]) - len(a["threads"]) == 2, (a["threads"], b["threads"])
        # The communication thread is named, and opens no team (whose members would inherit its name).
        assert b["threads"].count("phalanx-comm") == 1, b["threads"]
        # Without overlap the exchange runs on the training thread: no communication thread at all.
        assert "phalanx-comm" not in a["threads_without_overlap"] + b["threads_without_overlap"]
