"""A run whose stdout closes or fills under it trains on: `phalanx train | head -1`, a `tee` that
dies, or `phalanx train > /full/fs/log`.

Python raises BrokenPipeError at the first print after the reader went away; the worker on
rank 0 died there, the run ended with exit 1 and lost the steps since its last checkpoint (all
of them without --checkpoint-every), found by an outside operator's trial. Now the output ends,
one line on stderr says so, and the run finishes with every epoch's row in metrics.jsonl.
A full disk under a redirected stdout (ENOSPC, /dev/full here) killed rank 0 the same way, at
epoch 47 of 80 with no checkpoint in the same trial; stdout and stderr both on it ended the run
with nobody told.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
EPOCHS = 4


def test_a_run_whose_stdout_reader_exits_finishes_every_epoch(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "phalanx", "train", "--devices", "cpu:2", "--dataset", "synthetic",
                             "--epochs", str(EPOCHS), "--no-progress", "--threads-per-device", "1", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        first = proc.stdout.readline()  # as `| head -1` reads, then exits
        proc.stdout.close()
        stderr = proc.stderr.read()
        returncode = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert first.startswith("training lenet on"), first
    assert returncode == 0, stderr[-3000:]
    assert "phalanx: stdout was closed by its reader" in stderr and "training goes on" in stderr, stderr[-3000:]
    assert "BrokenPipeError" not in stderr, stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == list(range(1, EPOCHS + 1))
    assert (out / "model.pt").is_file()


def _train_into(out, *, stdout, stderr, extra=()):
    return subprocess.run([sys.executable, "-m", "phalanx", "train", "--devices", "cpu:2", "--dataset", "synthetic",
                           "--epochs", str(EPOCHS), "--no-progress", "--threads-per-device", "1", "--out", str(out),
                           *extra], stdout=stdout, stderr=stderr, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux) to fill stdout")
def test_a_run_whose_stdout_is_on_a_full_disk_trains_and_checkpoints(tmp_path):
    out = tmp_path / "run"
    with open("/dev/full", "w") as full:
        proc = _train_into(out, stdout=full, stderr=subprocess.PIPE, extra=("--checkpoint-every", "epoch"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "phalanx: stdout cannot be written (No space left on device)" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "OSError" not in proc.stderr, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == list(range(1, EPOCHS + 1))
    assert (out / "model.pt").is_file() and any((out / "checkpoints").iterdir())


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux) to fill stdout")
def test_a_run_whose_stdout_and_stderr_are_on_a_full_disk_finishes_silently(tmp_path):
    out = tmp_path / "run"
    with open("/dev/full", "w") as full:
        proc = _train_into(out, stdout=full, stderr=full)
    assert proc.returncode == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == list(range(1, EPOCHS + 1))
    assert (out / "model.pt").is_file()


# phalanx run's launcher writes only phalanx's own lines (the first line, restarts, the failure's
# headline), all to stderr; the script's prints are the workers'.
RUN_SCRIPT = """\
import sys
import torch
import phalanx

world = phalanx.init()
total = torch.ones(1)
torch.distributed.all_reduce(total)
if sys.argv[2] == "print":
    print(f"rank {world.rank} sums {total.item()}")
if world.rank == 0:
    open(sys.argv[1], "w").write(str(total.item()))
"""


def _run_script(tmp_path, *, stdout, stderr, script="script.py", mode="quiet"):
    (tmp_path / "script.py").write_text(RUN_SCRIPT)
    return subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", str(tmp_path / script),
                           str(tmp_path / "sum.txt"), mode], stdout=stdout, stderr=stderr, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux) to fill stdout")
def test_phalanx_runs_own_lines_on_a_full_disk_end_the_output_not_the_run(tmp_path):
    with open("/dev/full", "w") as full:
        ran = _run_script(tmp_path, stdout=full, stderr=full)
        # Was exit 1, the script never run: the launcher died writing its first line.
        assert ran.returncode == 0
        assert (tmp_path / "sum.txt").read_text() == "2.0"
        # Bad input keeps its exit code (was 1: the error line's OSError ended the launcher).
        assert _run_script(tmp_path, stdout=full, stderr=full, script="missing.py").returncode == 2


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux) to fill stdout")
def test_a_scripts_own_print_to_a_full_stdout_fails_as_under_python(tmp_path):
    with open("/dev/full", "w") as full:
        ran = _run_script(tmp_path, stdout=full, stderr=subprocess.PIPE, mode="print")
    # phalanx leaves the script's own output alone: its print raises, and the headline says so.
    assert ran.returncode == 1, ran.stderr[-3000:]
    assert "failed: OSError: [Errno 28] No space left on device" in ran.stderr.splitlines()[1], ran.stderr[-3000:]
