"""`phalanx run` and the library API end to end: a user's own script (examples/quickstart.py: an
MLP phalanx does not ship, Adam, a learning-rate warm-up, global-norm clipping, a torch Dataset)
on 1, 2 and 3 workers and under torchrun ends with the 1-device parameters and optimizer state
(float64, 1e-9 relative); stopped mid-warm-up and resumed (the schedule through `extras=`), too."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "quickstart.py"
# 301 examples in global batches of 50: the last batch holds 1 example, so on 3 workers two ranks
# have empty shards at that step. A max-norm this small clips every step (checked below).
ARGS = ["--dtype", "float64", "--examples", "301", "--batch-size", "50", "--epochs", "2", "--max-norm", "0.05"]
RTOL = 1e-9


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def phalanx_run(devices: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", devices, "--timeout", "60",
                           str(SCRIPT), *ARGS, "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def max_rel(a: dict, b: dict) -> float:
    worst = 0.0
    for key in b:
        scale = max(b[key].abs().max().item(), 1e-30)
        worst = max(worst, (a[key] - b[key]).abs().max().item() / scale)
    return worst


def adam_state(saved: dict) -> dict:
    state = saved["optimizer"]["state"]
    return {f"{i}.{name}": t for i, s in state.items() for name, t in s.items() if name != "step"}


def load(out: Path, rank: int) -> dict:
    return torch.load(out / f"rank{rank}.pt", weights_only=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("k1")
    proc = phalanx_run("cpu:1", out)
    assert "1 worker(s), 14 steps, clipped 14" in proc.stdout, proc.stdout
    return load(out, 0)


def test_three_workers_equal_one_device(reference, tmp_path):
    proc = phalanx_run("cpu:3", tmp_path)
    assert "3 worker(s), 14 steps, clipped 14" in proc.stdout
    lines = [line for line in proc.stdout.splitlines() if line.startswith("epoch")]
    assert len(lines) == 2  # rank 0 alone prints
    ranks = [load(tmp_path, r) for r in range(3)]
    for rank in ranks[1:]:  # replicas and their Adam state are identical, bitwise
        assert max_rel(rank["params"], ranks[0]["params"]) == 0.0
        assert max_rel(adam_state(rank), adam_state(ranks[0])) == 0.0
    assert max_rel(ranks[0]["params"], reference["params"]) < RTOL
    assert max_rel(adam_state(ranks[0]), adam_state(reference)) < RTOL


def test_same_script_under_torchrun(reference, tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    assert torchrun, "torchrun ships with torch and must be on PATH"
    proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", str(SCRIPT), *ARGS, "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 worker(s), 14 steps, clipped 14" in proc.stdout
    for rank in range(2):
        assert max_rel(load(tmp_path, rank)["params"], reference["params"]) < RTOL
        assert max_rel(adam_state(load(tmp_path, rank)), adam_state(reference)) < RTOL


def test_checkpoint_resumes_exactly(reference, tmp_path):
    """Two workers train epoch 1 and stop; a new run resumes from the checkpoint for epoch 2."""
    checkpoints = tmp_path / "ckpt"
    first = phalanx_run("cpu:2", tmp_path / "first", "--checkpoint-dir", str(checkpoints), "--epochs", "1")
    assert "7 steps" in first.stdout
    resumed = phalanx_run("cpu:2", tmp_path / "resumed", "--checkpoint-dir", str(checkpoints))
    assert "7 steps" in resumed.stdout and "epoch 1 " not in resumed.stdout  # only epoch 2 trained
    final = load(tmp_path / "resumed", 0)
    assert max_rel(final["params"], reference["params"]) < RTOL
    assert max_rel(adam_state(final), adam_state(reference)) < RTOL


def test_readme_example_runs_as_written(tmp_path):
    """The complete script in README's API section, copied out verbatim, trains on 2 workers."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Your model, your data, your loop", 1)[1]
    script = tmp_path / "readme_example.py"
    script.write_text(section.split("```python\n", 1)[1].split("```", 1)[0])
    proc = subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", str(script)],
                          capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 5 and lines[-1].startswith("epoch 5: loss"), lines
    assert float(lines[-1].rsplit("acc ", 1)[1]) > 0.9
