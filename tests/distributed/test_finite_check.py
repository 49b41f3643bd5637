"""A NaN on one rank under `phalanx run` (issue 28 item 4): the allreduce spreads it to every
replica, and DataParallel's finite check stops the run within its interval in one line naming
the step and the rank it came from - sharded too (each rank then sums its own range only); with
the check off the script ends 0 and saves NaN weights."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parent / "scripts" / "nan_on_one_rank.py"


def _run(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", "--timeout", "60", "--quiet",
                           str(SCRIPT), "--nan-step", "3", "--nan-rank", "1", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("shard", ["none", "gradients"])
def test_a_nan_on_one_rank_is_named_by_step_and_rank_within_the_check_interval(tmp_path, shard):
    done = _run(tmp_path, "--check-every", "5", "--shard", shard)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        "phalanx: run stopped: gradient NaN/Inf at step 3: rank 1's own gradient went non-finite first and the "
        "allreduce spread it to every replica (found at step 5's check, every 5 steps); look at that step's loss "
        "and data, or lower the lr; check_finite_every=0 turns this check off"]
    assert not (tmp_path / "model.pt").exists()


def test_with_the_check_off_the_nan_goes_unnoticed(tmp_path):
    done = _run(tmp_path, "--check-every", "0")
    assert done.returncode == 0, done.stderr[-2000:]
    weights = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(t.isnan().all() for t in weights.values())  # what the check is there to prevent
