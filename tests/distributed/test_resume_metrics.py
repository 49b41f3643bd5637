"""metrics.jsonl when a stopped run is resumed: a damaged file (torn by `truncate`, which phalanx's
whole-file atomic rewrite never leaves) is one line naming it, exit 2, before any worker starts,
with the file and the checkpoint untouched (was: rank 0's JSONDecodeError and a 20-line
traceback after the workers started); a deleted file resumes with one warning naming the epochs
whose rows are gone and where the plot starts (was: silence, and a file of the resumed epochs)."""

import json
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.distributed

PHALANX = [sys.executable, "-m", "phalanx"]
TRAIN = ["train", "--devices", "cpu:2", "--dataset", "synthetic", "--checkpoint-every", "epoch", "--no-progress"]


def _train(out, *extra: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run([*PHALANX, *TRAIN, "--out", str(out), *extra], capture_output=True, text=True, timeout=300)
    return done, time.monotonic() - started


def test_a_damaged_metrics_file_is_refused_before_work_and_a_deleted_one_is_named(tmp_path):
    out = tmp_path / "run"
    done, _ = _train(out, "--epochs", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    metrics, checkpoint = out / "metrics.jsonl", out / "checkpoints" / "checkpoint.pt"
    whole, saved = metrics.read_bytes(), checkpoint.read_bytes()

    metrics.write_bytes(whole[:300])  # truncate -s 300
    done, elapsed_s = _train(out, "--epochs", "3", "--resume", "auto")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-3000:]
    assert lines == [f"phalanx: error: {metrics} is damaged: line 1 is not a whole JSON row (phalanx writes the "
                     "file whole, so something else cut or changed it); restore it from a copy, or delete it to "
                     "resume without its rows (the checkpoint holds the training)"], done.stderr[-3000:]
    assert done.stdout == "" and elapsed_s < 30
    assert metrics.read_bytes() == whole[:300] and checkpoint.read_bytes() == saved

    metrics.unlink()
    done, _ = _train(out, "--epochs", "3", "--resume", "auto")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (f"phalanx: warning: {metrics} has no row for 2 epochs (1-2) of the 2 the checkpoint has trained "
            "(deleted?); training resumes from the checkpoint, those rows stay missing and accuracy.png starts "
            "at epoch 3") in done.stderr.splitlines(), done.stderr[-3000:]
    assert [json.loads(line)["epoch"] for line in metrics.read_text().splitlines()] == [3]
