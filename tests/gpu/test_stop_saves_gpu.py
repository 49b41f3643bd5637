"""A scheduler's SIGTERM on one GPU: the stop check runs every --check-every steps there (the
steps that read the device anyway), outside the captured step; the run saves where it stops and
`--resume auto` ends where the run nobody stopped ends (float64; the CPU version of this test is
tests/distributed/test_stop_saves.py). Skipped where no GPU is present."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from phalanx.train.checkpoint import read_checkpoint
from tests.distributed.test_faults import _wait_for

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TRAIN = [sys.executable, "-m", "phalanx", "train", "--devices", "cuda:0", "--dataset", "synthetic", "--dtype",
         "float64", "--epochs", "4", "--batch-size", "512", "--seed", "5", "--check-every", "5", "--no-progress"]


def _run(out, *extra) -> subprocess.CompletedProcess:
    return subprocess.run([*TRAIN, "--out", str(out), *extra], capture_output=True, text=True, timeout=300)


def test_a_sigterm_on_one_gpu_saves_at_a_check_step_and_resumes(tmp_path):
    whole = _run(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    out = tmp_path / "stopped"
    proc = subprocess.Popen([*TRAIN, "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _wait_for(out / "metrics.jsonl")
        os.kill(proc.pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, stderr[-3000:]
    match = re.search(r"stopped by SIGTERM after epoch (\d+), step (\d+) of 12, saved in", stderr)
    assert match, stderr[-3000:]
    epoch, step = int(match[1]), int(match[2])
    assert ((epoch - 1) * 12 + step) % 5 == 0  # a --check-every step
    state = read_checkpoint(out / "checkpoints")
    assert (state["epoch"], state["step"]) == (epoch - 1, step)
    resumed = _run(out, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = torch.load(out / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)
    for name in b:  # cuDNN may pick another algorithm in a new process: equal to rounding, not bitwise
        torch.testing.assert_close(a[name], b[name], rtol=1e-9, atol=1e-12)
