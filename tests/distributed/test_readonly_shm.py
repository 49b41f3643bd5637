"""A read-only /dev/shm (a container that mounts it so): runs still start and train. The launcher's
table of each rank's last step (multiprocessing's shared memory, a file in /dev/shm) is then
left out - a failure line names no step - and the allreduce falls back to gloo's, saying why in
the first line; no traceback. Simulated in a private mount namespace (`unshare -m`, a read-only
tmpfs over /dev/shm); skipped where this process may not make one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed


def _under_readonly_shm(*command: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    inner = "mount -t tmpfs -o ro tmpfs /dev/shm && exec " + " ".join(f"'{part}'" for part in command)
    return subprocess.run(["unshare", "-m", "sh", "-c", inner], capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def readonly_shm():
    if shutil.which("unshare") is None:
        pytest.skip("no unshare here")
    probe = _under_readonly_shm("sh", "-c", "touch /dev/shm/probe", timeout_s=30)
    if "Read-only file system" not in probe.stderr:
        pytest.skip(f"cannot mount a read-only /dev/shm here: {probe.stderr.strip()[:200]}")


def test_a_script_runs_on_a_readonly_dev_shm_without_a_traceback(readonly_shm, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2
        dist.barrier()
        dist.destroy_process_group()
    """))
    done = _under_readonly_shm(sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", "--quiet", str(script))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def test_training_falls_back_to_gloo_and_says_why(readonly_shm, tmp_path):
    done = _under_readonly_shm(sys.executable, "-m", "phalanx", "train", "--devices", "cpu:2", "--dataset", "synthetic",
                               "--epochs", "1", "--no-progress", "--threads-per-device", "1",
                               "--out", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "allreduce native = gloo's own allreduce (auto: /dev/shm is missing or not writable)" in done.stdout
    assert "Traceback" not in done.stderr and Path(tmp_path / "run" / "model.pt").is_file()
