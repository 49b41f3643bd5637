"""Every python block of docs/api.md runs: the complete script with its
continuing snippets (accumulation, logging, saving on rank 0, a barrier, gathered predictions, a
script's own checkpoint) under `phalanx run --devices cpu:2`, twice - the second run resumes what
the first saved - and every other script on the page as it stands (torch.compile's in one
process, skipped where compiling takes longer than a test should; phalanx.launch's with python,
as it starts its own workers)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.unit.api_doc import API_DOC, REPO, continued_script, python_blocks

pytestmark = pytest.mark.distributed


def _phalanx_run(script, cwd, timeout: float = 240, devices: str | None = "cpu:2") -> subprocess.CompletedProcess:
    """`phalanx run --devices cpu:2 script` (`devices=None`: `python script`, a world of one);
    past `timeout` it is stopped as a user stops it (SIGTERM: the launcher takes its workers
    down) and TimeoutExpired raised."""
    launch = ["-m", "phalanx", "run", "--devices", devices, "--timeout", "60", "--quiet"] if devices else []
    proc = subprocess.Popen([sys.executable, *launch, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        finally:
            proc.kill()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def test_the_complete_script_and_its_snippets_run_and_resume(tmp_path):
    script = tmp_path / "api_doc_script.py"
    script.write_text(continued_script(python_blocks(API_DOC.read_text())))
    first, second = (_phalanx_run(script, tmp_path) for _ in range(2))
    for done in (first, second):
        assert done.returncode == 0, done.stderr[-3000:]
        lines = done.stdout.splitlines()
        assert [line.split(":")[0] for line in lines[:5]] == [f"epoch {e}" for e in range(1, 6)]
        (predictions,) = [line for line in lines if "predictions" in line]
        assert predictions.startswith("1201 predictions, accuracy ")
    assert first.stdout.splitlines()[-1] == "trained epoch 8"
    assert second.stdout.splitlines()[-1] == "trained epoch 9"  # it went on from the first run's checkpoint
    rows = [json.loads(line) for line in (tmp_path / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == [7] and rows[0]["last_batch_loss"] > 0
    assert (tmp_path / "model.pt").is_file()


@pytest.mark.parametrize("index", [i for i, (continues, _) in enumerate(python_blocks(API_DOC.read_text()))
                                   if i > 0 and not continues])
def test_every_other_script_on_the_page_runs(tmp_path, index):
    code = python_blocks(API_DOC.read_text())[index][1]
    script = tmp_path / f"api_doc_{index}.py"
    script.write_text(code)
    compiles = "torch.compile" in code
    if "phalanx.launch(" in code:  # it starts its own workers: run as python runs it, not under phalanx run
        done = _phalanx_run(script, tmp_path, devices=None)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip().splitlines()[-1].endswith("the same on every rank: True"), done.stdout
        return
    try:
        # Compiling: one process (inductor builds C++ kernels; two workers at once on 2 busy cores took 26 s).
        done = _phalanx_run(script, tmp_path, timeout=20 if compiles else 240, devices=None if compiles else "cpu:2")
    except subprocess.TimeoutExpired:
        pytest.skip("torch.compile took more than 20 s here; compile before and after prepare is tested in "
                    "tests/unit/test_prepare.py (dynamo without inductor)")
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    # On CPU workers the captured step runs eagerly, said once.
    assert last in ("compiled and trained", "captured step trained (eager)", "random step trained")
    if last.startswith("captured"):
        assert done.stdout.count("step not captured, running eagerly: CUDA graphs need CUDA devices") == 1
