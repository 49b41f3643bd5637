"""Resuming on another device count is exact, model and metrics: a run killed mid-epoch on 2 devices
and finished on 1 (and the other way round) ends with the uninterrupted run's model (<= 1e-12
relative, float64) and its metrics rows - the epoch's running sums are stored reduced over the
ranks, so none are lost when a rank goes away. Resume refuses a checkpoint of another data set in
one line, says what changed (--lr, devices) and marks the epoch row that mixes two rates, and
"nothing to train" states the checkpoint's true position.

float64 LeNet on synthetic data (its first 3,000 images), 2 epochs of 24 steps of 128 images; the
interrupted runs SIGKILL rank 0 right after the checkpoint at epoch 2, step 10 (global step 34)
lands (a driver script patches save_checkpoint).
"""

import shutil
from pathlib import Path

import pytest

from tests.distributed.runs import (assert_same_rows, crash_script, finished_run, metrics_rows, relative_difference,
                                    run_phalanx)

pytestmark = pytest.mark.distributed

COMMON = ["train", "--dataset", "synthetic", "--train-examples", "3000", "--batch-size", "128", "--dtype", "float64",
          "--no-progress", "--threads-per-device", "1", "--epochs", "2", "--checkpoint-every", "17"]


def _assert_uninterrupted(got: Path, want: Path) -> None:
    worst = relative_difference(got, want)
    assert worst <= 1e-12, f"final weights differ by {worst:.3g} (relative)"
    assert_same_rows(got, want, rel=1e-12)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return finished_run(tmp_path_factory.mktemp("reference") / "run", *COMMON, "--devices", "cpu:2")


def _crashed(tmp_path_factory, devices: str) -> Path:
    base = tmp_path_factory.mktemp(f"crashed-{devices.replace(':', '')}")
    out = base / "run"
    crashed = run_phalanx(*COMMON, "--devices", devices, "--out", str(out), script=crash_script(base))
    assert crashed.returncode != 0 and len(metrics_rows(out)) == 1, crashed.stderr[-2000:]  # epoch 2 did not finish
    return out


@pytest.fixture(scope="module")
def crashed_on_2(tmp_path_factory) -> Path:
    return _crashed(tmp_path_factory, "cpu:2")


@pytest.fixture(scope="module")
def crashed_on_1(tmp_path_factory) -> Path:
    return _crashed(tmp_path_factory, "1")  # one device runs in the launcher: the kill ends it all


def _copy(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


@pytest.mark.parametrize("before, after", [("cpu:2", "1"), ("1", "cpu:2")])
def test_resuming_mid_epoch_on_another_device_count_gives_the_uninterrupted_run(
        reference, crashed_on_2, crashed_on_1, tmp_path, before, after):
    out = _copy(crashed_on_2 if before == "cpu:2" else crashed_on_1, tmp_path)
    resumed = run_phalanx(*COMMON, "--devices", after, "--out", str(out), "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    counts = "2 -> 1" if before == "cpu:2" else "1 -> 2"
    assert f"at epoch 2, step 10; changed since the checkpoint: devices {counts}" in resumed.stdout, resumed.stdout
    # The summary's seconds per epoch are this device set's alone, and say so.
    assert resumed.stdout.strip().splitlines()[-1].endswith("(epochs on these devices: 1 of 2)"), resumed.stdout
    _assert_uninterrupted(out, reference)


def test_a_checkpoint_of_another_data_set_is_refused_in_one_line(crashed_on_2, tmp_path, idx_dir):
    out = _copy(crashed_on_2, tmp_path)
    before = {p.name: p.read_bytes() for p in (out / "checkpoints").iterdir()}
    refused = run_phalanx(*COMMON, "--devices", "cpu:2", "--data-dir", str(idx_dir), "--dataset", "fashion-mnist",
                         "--out", str(out), "--resume", "auto")
    assert refused.returncode == 2, refused.stderr[-2000:]
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    assert lines[0].startswith(f"phalanx: error: checkpoint {out / 'checkpoints' / 'checkpoint.pt'} was trained on "
                               "synthetic (3000 train / 1000 test images, sha256 "), lines[0]
    assert "but this run has fashion-mnist (3000 train / 1000 test images, sha256 " in lines[0], lines[0]
    assert lines[0].endswith("resume with the data set it was trained on (--dataset / --data-dir / --train-examples)")
    assert {p.name: p.read_bytes() for p in (out / "checkpoints").iterdir()} == before


def test_nothing_to_train_states_the_checkpoints_true_position(crashed_on_2, tmp_path):
    out = _copy(crashed_on_2, tmp_path)
    done = run_phalanx(*COMMON, "--devices", "cpu:2", "--epochs", "1", "--out", str(out), "--resume", "auto")
    assert done.returncode == 0, done.stderr[-2000:]
    assert ("nothing to train: the checkpoint is at epoch 2, step 10 of 24, and --epochs is 1; "
            "pass --epochs 2 or more to go on") in done.stdout, done.stdout


def test_a_changed_lr_is_named_and_the_epoch_that_mixes_two_rates_says_so(crashed_on_2, tmp_path):
    out = _copy(crashed_on_2, tmp_path)
    done = run_phalanx(*COMMON, "--devices", "cpu:2", "--lr", "0.1", "--out", str(out), "--resume", "auto")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "at epoch 2, step 10; changed since the checkpoint: --lr 0.2 -> 0.1" in done.stdout, done.stdout
    epoch_2 = next(line for line in lines if line.startswith("epoch   2"))
    assert epoch_2.endswith("(lr 0.2 for its first 10 steps, 0.1 after the resume)"), epoch_2
    first, second = metrics_rows(out)
    assert first["lr"] == 0.2 and "lr_before_resume" not in first
    assert (second["lr"], second["lr_before_resume"], second["steps_before_resume"]) == (0.1, 0.2, 10)
