"""`phalanx run` of a DDP script whose DistributedSampler never has set_epoch called: rank 0 says so
once, at the script's loop line, when it reaches the end of a second training pass at one epoch; and of one that
evaluates over a sampler that pads its set: rank 0 says so once, at the evaluation's line
(runtime/sampler_passes.py). Before 2026-12-07 every epoch read the first epoch's order, and the
evaluation counted an example twice, and nothing was said (torchrun says nothing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parent / "scripts" / "sampler_passes.py"


def _run(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", "--threads-per-device", "1",
                           "--timeout", "60", "--quiet", str(SCRIPT), mode], capture_output=True, text=True,
                          timeout=240, env=dict(os.environ))


def _said_once(mode: str, marker: str) -> tuple[str, str, list[str]]:
    """The run's one PhalanxWarning, where it must point (the script's line holding `marker`), and its stdout."""
    done = _run(mode)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "PhalanxWarning" in line]
    assert len(lines) == 1, done.stderr[-3000:]
    at = next(n for n, line in enumerate(SCRIPT.read_text().splitlines(), 1) if marker in line)
    return lines[0], f"{SCRIPT}:{at}: PhalanxWarning: ", sorted(done.stdout.splitlines())


def test_a_forgotten_set_epoch_is_said_once_on_rank_0_at_the_loop():
    line, where, printed = _said_once("forgets", "the epoch's loop")
    assert line.startswith(f"{where}this DistributedSampler (shuffle=True) reached the end of a second training "
                           "pass at epoch 0: its set_epoch was not called"), line
    assert printed == ["rank 0 distinct first batches 1", "rank 1 distinct first batches 1"]


def test_a_loop_that_sets_the_epoch_hears_nothing():
    done = _run("sets")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "PhalanxWarning" not in done.stderr, done.stderr[-3000:]
    assert sorted(done.stdout.splitlines()) == ["rank 0 distinct first batches 4", "rank 1 distinct first batches 4"]


def test_an_evaluation_over_a_padding_sampler_is_said_once_on_rank_0_at_its_line():
    line, where, _ = _said_once("evaluates", "the evaluation")
    assert line.startswith(f"{where}this DistributedSampler reached the end of an evaluation's pass (no optimizer "
                           "step, gradients off) that reads 1 of its 31 examples twice"), line
