"""Resuming is exact: an interrupted run continued with --resume ends where an uninterrupted one does.

float64 LeNet on synthetic data (its first 3,000 images), 2 CPU workers, 2 epochs of 24 steps of
128 images, the last one short. The reference trains
straight through (checkpointing as it goes: saving must not change training). Interrupted at an
epoch boundary: `--epochs 1`, then the same command with `--epochs 2 --resume`. Interrupted
mid-epoch: a driver script makes rank 0 SIGKILL itself right after the checkpoint at epoch 2,
step 10 lands (the patch is at module level, so spawned workers run it too); the run exits
non-zero naming the dead rank, then `--resume auto` finishes it. Final weights and every
metrics row (loss, accuracy) must match the reference bitwise: the data order is a pure function
of (seed, epoch), the RNG states are restored, and on the same device count every rank continues
its own running sums, so the epoch's loss is added up in the uninterrupted run's order.
Ctrl-C (SIGINT to the process group) stops the run at once with exit 130, no worker left and the
last checkpoint intact. A checkpoint damaged on disk (a byte flipped inside a tensor) gives way
to the one before it under `--resume auto`, which says so, and the run still ends where an
uninterrupted one does - also when the resumed run's first checkpoint write then fails (a full
disk, or rank 0 killed during the write: simulated at the fsync of the file's bytes) and the run
is resumed again: the damaged file was set aside and the failed write rotated nothing, so the
good generation is still there.
"""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from phalanx.train import checkpoint as ckpt
from tests.distributed.runs import (crash_script, final_weights, finished_run, flip_record_byte, metrics_rows, run_phalanx,
                                   started_phalanx)

# A driver script: rank 0's write of a checkpoint fails at the fsync of its bytes - a full disk
# (ENOSPC) or a kill (SIGKILL) - as FAIL_CHECKPOINT_WRITE says. Patched at module level (the
# spawned workers re-import it); RANK is read at the call, once the worker has its environment.
FAIL_CHECKPOINT_WRITE = textwrap.dedent("""
    import errno, os, signal
    real_fsync = os.fsync
    def failing_fsync(fd):
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            name = ""
        if os.environ.get("RANK") == "0" and "/.checkpoint.pt." in name:
            if os.environ["FAIL_CHECKPOINT_WRITE"] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)
    os.fsync = failing_fsync
    if __name__ == "__main__":
        import sys
        from phalanx.cli import main
        sys.exit(main(sys.argv[1:]))
""")

pytestmark = pytest.mark.distributed

COMMON = ["train", "--devices", "cpu:2", "--dataset", "synthetic", "--train-examples", "3000", "--batch-size", "128",
          "--dtype", "float64", "--no-progress", "--threads-per-device", "1"]


def _assert_same_run(got: Path, want: Path) -> None:
    a, b = final_weights(got, want)
    worst = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), f"final weights differ by {worst}"
    rows_a, rows_b = metrics_rows(got), metrics_rows(want)
    assert [r["epoch"] for r in rows_a] == [r["epoch"] for r in rows_b] == [1, 2]
    for ra, rb in zip(rows_a, rows_b):
        for key in ("train_loss", "train_acc", "test_acc"):
            assert ra[key] == rb[key], (ra["epoch"], key, ra[key] - rb[key])  # bitwise


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "run"
    return finished_run(out, *COMMON, "--epochs", "2", "--checkpoint-every", "17")


def test_resume_at_an_epoch_boundary_matches_an_uninterrupted_run(reference, tmp_path):
    out = tmp_path / "run"
    first = run_phalanx(*COMMON, "--epochs", "1", "--checkpoint-every", "epoch", "--out", str(out))
    assert first.returncode == 0, first.stderr[-2000:]
    second = run_phalanx(*COMMON, "--epochs", "2", "--checkpoint-every", "epoch", "--out", str(out),
                         "--resume", str(out / "checkpoints"))
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from" in second.stdout and "at epoch 2, step 0" in second.stdout, second.stdout[-1500:]
    _assert_same_run(out, reference)


def test_resume_mid_epoch_after_a_crash_matches_an_uninterrupted_run(reference, tmp_path):
    script = crash_script(tmp_path)
    out = tmp_path / "run"
    crashed = run_phalanx(*COMMON, "--epochs", "2", "--checkpoint-every", "17", "--out", str(out), script=script)
    assert crashed.returncode != 0
    assert "worker rank 0 failed: died (signal SIGKILL)" in crashed.stderr, crashed.stderr[-2000:]
    assert len(metrics_rows(out)) == 1  # epoch 1 finished, epoch 2 did not
    resumed = run_phalanx(*COMMON, "--epochs", "2", "--checkpoint-every", "17", "--out", str(out), "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "at epoch 2, step 10" in resumed.stdout, resumed.stdout[-1500:]
    _assert_same_run(out, reference)


def test_a_damaged_checkpoint_gives_way_to_the_one_before_it_and_the_run_ends_the_same(reference, tmp_path):
    out = tmp_path / "run"
    first = run_phalanx(*COMMON, "--epochs", "1", "--checkpoint-every", "17", "--out", str(out))
    assert first.returncode == 0, first.stderr[-2000:]
    newest = out / "checkpoints" / "checkpoint.pt"  # epoch 1's end; the one before it: epoch 1, step 17
    record = flip_record_byte(newest)
    resumed = run_phalanx(*COMMON, "--epochs", "2", "--checkpoint-every", "17", "--out", str(out), "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert resumed.stdout.splitlines()[0] == (
        f"resumed from {out / 'checkpoints' / 'checkpoint.previous.pt'} at epoch 1, step 17; {newest} is damaged: "
        f"its record {record} fails its CRC-32 check (the bytes changed after they were written), so this is the "
        "checkpoint before it (kept as checkpoint.damaged.pt, no longer a checkpoint); changed since the "
        "checkpoint: --epochs 1 -> 2"), resumed.stdout[-1500:]
    _assert_same_run(out, reference)


@pytest.mark.parametrize("failure", ["full", "kill"])
def test_a_fall_back_then_a_failed_first_save_still_leaves_the_good_checkpoint(reference, tmp_path, failure):
    out = tmp_path / "run"
    checkpoints = out / "checkpoints"
    first = run_phalanx(*COMMON, "--epochs", "1", "--checkpoint-every", "17", "--out", str(out))
    assert first.returncode == 0, first.stderr[-2000:]
    flip_record_byte(checkpoints / "checkpoint.pt")  # epoch 1's end; the one before it: epoch 1, step 17
    driver = tmp_path / "fail_checkpoint_write.py"
    driver.write_text(FAIL_CHECKPOINT_WRITE)
    failed = subprocess.run([sys.executable, str(driver), *COMMON, "--epochs", "2", "--checkpoint-every", "17",
                             "--out", str(out), "--resume", "auto"], capture_output=True, text=True, timeout=240,
                            env={**os.environ, "FAIL_CHECKPOINT_WRITE": failure})
    assert failed.returncode != 0, failed.stderr[-2000:]
    assert "so this is the checkpoint before it (kept as checkpoint.damaged.pt" in failed.stdout, failed.stdout[-2000:]
    why = "died (signal SIGKILL)" if failure == "kill" else f"cannot write {checkpoints / 'checkpoint.pt'} (No space"
    assert why in failed.stderr, failed.stderr[-2000:]
    if failure == "kill":  # rank 1, left, saved the step the run reached (job/survivors.py): the good one before it
        assert "the run was saved where it stopped" in failed.stderr, failed.stderr[-2000:]
        assert ckpt.read_checkpoint(checkpoints / "checkpoint.previous.pt")["step"] == 17
    resumed = run_phalanx(*COMMON, "--epochs", "2", "--checkpoint-every", "17", "--out", str(out), "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert resumed.stdout.splitlines()[0].startswith(
        f"resumed from {checkpoints / 'checkpoint.pt'} at epoch 1, step 24" if failure == "kill" else
        f"resumed from {checkpoints / 'checkpoint.previous.pt'} at epoch 1, step 17; {checkpoints / 'checkpoint.pt'} "
        "is missing, so this is the checkpoint before it"), resumed.stdout[-1500:]
    _assert_same_run(out, reference)


def test_ctrl_c_stops_within_a_step_and_saves_there(tmp_path):
    # Before 2026-12-02 it stopped at once, leaving the last periodic checkpoint (an operator's trial).
    out = tmp_path / "run"
    with started_phalanx(*COMMON, "--dtype", "float32", "--epochs", "200", "--checkpoint-every", "5",
                         "--out", str(out)) as proc:
        deadline = time.monotonic() + 120
        # Epoch 1's checkpoint is written right after its metrics row (so a crash between the two
        # resumes one epoch early and rewrites the row); epoch 2's row proves it is on disk.
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert time.monotonic() < deadline and proc.poll() is None, "training never got under way"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends
        sent = time.monotonic()
        _, stderr = proc.communicate(timeout=30)
        elapsed_s = time.monotonic() - sent
    assert proc.returncode == 130, stderr[-2000:]
    assert elapsed_s < 10
    said = re.fullmatch(r"phalanx: stopped by SIGINT after epoch (\d+), step (\d+) of \d+, saved in .+; run the "
                        r"same command with --resume auto to continue", stderr.strip().splitlines()[-1])
    assert said, stderr[-2000:]
    from phalanx.train import checkpoint as ckpt

    state = ckpt.read_checkpoint(out / "checkpoints")  # whole and loadable, where the line says
    assert (state["epoch"] + 1, state["step"]) == (int(said[1]), int(said[2])) and state["epoch"] >= 1
    kept = ("checkpoint.pt", "checkpoint.previous.pt")  # the last checkpoint and the one before it
    assert not [p for p in (out / "checkpoints").iterdir() if p.name not in kept], "temp file left behind"


def test_a_run_stopped_after_its_last_checkpoint_is_finished_by_the_resume(tmp_path):
    # A restart that lands after the final epoch's checkpoint (while the run evaluated or wrote
    # model.pt) must finish the run, not stop at "nothing to train" with no model.pt.
    out = tmp_path / "run"
    first = run_phalanx(*COMMON, "--epochs", "1", "--checkpoint-every", "epoch", "--out", str(out))
    assert first.returncode == 0, first.stderr[-2000:]
    model_bytes = (out / "model.pt").read_bytes()
    (out / "model.pt").unlink()
    again = run_phalanx(*COMMON, "--epochs", "1", "--checkpoint-every", "epoch", "--out", str(out), "--resume", "auto")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "training was complete at the checkpoint (the end of epoch 1)" in again.stdout, again.stdout
    assert "nothing to train" not in again.stdout
    # The same model's accuracy, and the kept metrics row's epoch time.
    assert again.stdout.strip().splitlines()[-1] == first.stdout.strip().splitlines()[-1]
    assert (out / "model.pt").read_bytes() == model_bytes
    assert [r["epoch"] for r in metrics_rows(out)] == [1]
