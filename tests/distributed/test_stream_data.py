"""A stream (an IterableDataset) under `phalanx run`: ShardedLoader cuts its global batches as one
device reads them, loader workers included, and evaluate_dataset counts every item once.

scripts/stream_train.py trains 2 epochs on a 53-item stream (global batch 16: the last batch has
5 items) split among its DataLoader workers by get_worker_info and reshuffled by set_epoch, then
evaluates a 29-item test stream. On 2 workers with 2 loader workers each, and on 3 workers
without, it ends within 1e-12 (float64) of one device without loader workers, with the same
evaluation sums and step count.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parent / "scripts" / "stream_train.py"


def _run(out: Path, *launcher: str, workers: str = "0") -> dict:
    done = subprocess.run([sys.executable, *launcher, str(SCRIPT), str(out), "--workers", workers], capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("devices, workers", [("cpu:2", "2"), ("cpu:3", "0")])
def test_a_stream_trains_and_evaluates_as_on_one_device(tmp_path, devices, workers):
    one = _run(tmp_path / "one.pt")
    k = _run(tmp_path / "k.pt", "-m", "phalanx", "run", "--devices", devices, "--threads-per-device", "1", "--quiet",
             workers=workers)
    assert k["steps"] == one["steps"] == 8 and k["sums"]["count"] == one["sums"]["count"] == 29
    for name, value in one["sums"].items():
        assert abs(k["sums"][name] - value) <= 1e-12 * max(1.0, abs(value)), name
    worst = max(((k["model"][n] - w).abs().max() / w.abs().max()).item() for n, w in one["model"].items())
    assert worst <= 1e-12, f"{worst:.3g} (relative) from one device"
