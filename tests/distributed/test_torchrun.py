"""The same job under torchrun: phalanx joins the launcher's world instead of spawning its own."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed


def test_torchrun_two_processes(tmp_path, idx_dir):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    assert torchrun, "torchrun ships with torch and must be on PATH"
    out = tmp_path / "tr"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2",
         "-m", "phalanx", "train", "--data-dir", str(idx_dir), "--epochs", "1", "--no-progress",
         "--out", str(out)],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].endswith("sec/epoch on [cpu:0, cpu:1]"), lines
    assert sum(line.startswith("epoch ") for line in lines) == 1
    state = torch.load(out / "model.pt", weights_only=True)
    assert set(state) >= {"conv1.weight", "fc2.bias"}
