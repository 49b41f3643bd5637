"""A worker of `phalanx train` that dies loses no step (job/survivors.py): the ranks left save the step
the run reached, and the resumed or restarted run ends bitwise where the uninterrupted one does.

float64 LeNet on synthetic data (3,000 images), 2 CPU workers, 2 epochs of 24 steps of 128, a periodic
checkpoint every 10 steps. The driver SIGKILLs one rank right after it posted a step (KILL_STEP) - or
just before (KILL_BEFORE_POST), where its sums of that step are lost and no save may be made; under
phalanx's launcher and under torchrun. Before 2026-12-07 a death went back to the periodic
checkpoint (step 10 of 17: 7 steps trained again).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.distributed.runs import assert_same_rows, final_weights, finished_run, metrics_rows, run_phalanx, TIMEOUT_S

pytestmark = pytest.mark.distributed

TWO = ["--devices", "cpu:2"]  # phalanx's own launcher; under torchrun its --nproc-per-node
COMMON = ["train", "--dataset", "synthetic", "--train-examples", "3000", "--batch-size", "128", "--dtype", "float64",
          "--epochs", "2", "--checkpoint-every", "10", "--no-progress", "--threads-per-device", "1"]

# Patched at module level, so the spawned workers (which re-import the main module) run it too; a
# restarted attempt (TORCHELASTIC_RESTART_COUNT > 0) is left alone.
KILL_AT_POST = textwrap.dedent("""
    import os, signal
    import torch
    from phalanx.job import survivors
    real_post, real_backward, in_next_backward = survivors.SurvivorsSave.post, torch.Tensor.backward, []
    def post_or_die(self, epoch, done, totals):
        due = (self.world.rank == int(os.environ["KILL_RANK"]) and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
               and epoch * self.steps_per_epoch + done == int(os.environ["KILL_STEP"]))
        if due and os.environ.get("KILL_BEFORE_POST"):
            os.kill(os.getpid(), signal.SIGKILL)
        real_post(self, epoch, done, totals)
        if due and os.environ.get("KILL_IN_NEXT_BACKWARD"):
            in_next_backward.append(True)
        elif due and os.environ.get("STOP_AFTER_POST"):
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen: its peers wait --timeout, then name it
        elif due and os.environ.get("RAISE_AFTER_POST"):
            raise OSError("the injected error: a file this rank reads is gone")
        elif due:
            os.kill(os.getpid(), signal.SIGKILL)
    def backward_or_die(self, *args, **kwargs):
        if in_next_backward:  # every rank's forward of the next step ran (its SyncBatchNorm sums need them all)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_backward(self, *args, **kwargs)
    survivors.SurvivorsSave.post, torch.Tensor.backward = post_or_die, backward_or_die
    if __name__ == "__main__":
        import sys
        from phalanx.cli import main
        sys.exit(main(sys.argv[1:]))
""")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return finished_run(tmp_path_factory.mktemp("reference") / "run", *COMMON, *TWO)


def _killed(tmp_path: Path, *args: str, rank: int, step: int, when: str = "", launcher: tuple = ()):
    """`phalanx train` (COMMON + args) whose rank `rank` is SIGKILLed at its post of global step `step`
    (`when`: "KILL_BEFORE_POST", "KILL_IN_NEXT_BACKWARD", "STOP_AFTER_POST": SIGSTOP, "RAISE_AFTER_POST":
    an error of its own, else right after it); `launcher`: the command
    that starts the script (default: python, phalanx's own launcher)."""
    script = tmp_path / "kill_at_post.py"
    script.write_text(KILL_AT_POST)
    env = {**os.environ, "KILL_RANK": str(rank), "KILL_STEP": str(step), **({when: "1"} if when else {})}
    return subprocess.run([*(launcher or (sys.executable,)), str(script), *COMMON, *(() if launcher else TWO), *args],
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def _position(path: Path) -> tuple[int, int, dict | None]:
    state = torch.load(path, weights_only=True)
    return state["epoch"], state["step"], state.get("survivors")


def _assert_bitwise_equal(got: Path, want: Path) -> None:
    a, b = final_weights(got, want)
    assert all(torch.equal(a[k], b[k]) for k in b), "the run must end bitwise where the uninterrupted one does"
    assert_same_rows(got, want, rel=0)
    assert [r["train_loss"] for r in metrics_rows(got)] == [r["train_loss"] for r in metrics_rows(want)]


def test_rank_0_saves_the_step_rank_1_died_after_and_the_resume_ends_bitwise_equal(reference, tmp_path):
    out = tmp_path / "run"
    done = _killed(tmp_path, "--out", str(out), rank=1, step=17)
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.startswith("phalanx: worker rank 1 failed: died (signal SIGKILL) after step 17"), done.stderr
    said = done.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"the run was saved where it stopped: \S+/checkpoints/checkpoint\.pt \(epoch 1, step 17, "
                        r"saved by rank 0 when rank 1 was lost\); run the same command with --resume auto to "
                        r"continue", said), said
    epoch, step, note = _position(out / "checkpoints" / "checkpoint.pt")
    assert (epoch, step, note["lost_ranks"], note["by_rank"]) == (0, 17, [1], 0)
    assert _position(out / "checkpoints" / "checkpoint.previous.pt") == (0, 10, None)  # the periodic one, kept
    resumed = run_phalanx(*COMMON, *TWO, "--out", str(out), "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at epoch 1, step 17" in resumed.stdout, resumed.stdout[-2000:]
    _assert_bitwise_equal(out, reference)


def test_rank_1_saves_when_rank_0_dies_and_the_restart_goes_on_from_there(reference, tmp_path):
    out = tmp_path / "run"
    done = _killed(tmp_path, "--out", str(out), "--max-restarts", "1", rank=0, step=30)
    assert done.returncode == 0, done.stderr[-3000:]
    restart = [line for line in done.stderr.splitlines() if "restart 1 of 1" in line]
    assert len(restart) == 1 and re.search(r"restart 1 of 1 from \S+checkpoint\.pt \(epoch 2, step 6, saved by rank 1 "
                                           r"when rank 0 was lost\) on 2 devices", restart[0]), done.stderr[-3000:]
    _assert_bitwise_equal(out, reference)


def test_no_save_when_the_dead_rank_had_not_posted_its_last_step(reference, tmp_path):
    out = tmp_path / "run"
    done = _killed(tmp_path, "--out", str(out), rank=1, step=17, when="KILL_BEFORE_POST")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "saved where it stopped" not in done.stderr, done.stderr[-3000:]
    assert _position(out / "checkpoints" / "checkpoint.pt") == (0, 10, None)  # its sums of step 17 are lost


def test_under_torchrun_the_worker_left_says_it_saved_and_torchruns_restart_goes_on_from_there(reference, tmp_path):
    out = tmp_path / "run"
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    done = _killed(tmp_path, "--out", str(out), rank=1, step=17, launcher=torchrun)
    assert done.returncode != 0
    assert re.search(r"; rank 0 saved the run where it stopped, \S+checkpoint\.pt \(epoch 1, step 17\): torchrun's "
                     r"--max-restarts, or the same command with --resume auto, goes on from there", done.stderr), \
        done.stderr[-3000:]
    restarted = _killed(tmp_path, "--out", str(tmp_path / "restarted"), rank=1, step=17,
                        launcher=(*torchrun, "--max-restarts", "1"))
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "resumed from" in restarted.stdout and "at epoch 1, step 17" in restarted.stdout, restarted.stdout[-2000:]
    _assert_bitwise_equal(tmp_path / "restarted", reference)


@pytest.fixture(scope="module")
def batchnorm_reference(tmp_path_factory) -> Path:
    return finished_run(tmp_path_factory.mktemp("reference") / "run", *COMMON, *TWO, "--model", "lenet-bn")


@pytest.mark.parametrize("when", ["", "KILL_IN_NEXT_BACKWARD"])
def test_a_batchnorm_model_is_saved_too_with_the_statistics_of_its_last_step(batchnorm_reference, tmp_path, when):
    # SyncBatchNorm (the default) keeps every rank's running statistics the same. Killed in step 18's
    # backward, every survivor's forward of step 18 has moved them: the save puts step 17's back.
    out = tmp_path / "run"
    done = _killed(tmp_path, "--out", str(out), "--model", "lenet-bn", rank=1, step=17, when=when)
    assert done.returncode == 1 and "the run was saved where it stopped" in done.stderr, done.stderr[-3000:]
    resumed = run_phalanx(*COMMON, *TWO, "--model", "lenet-bn", "--out", str(out), "--resume", "auto")
    assert resumed.returncode == 0 and "at epoch 1, step 17" in resumed.stdout, resumed.stderr[-3000:]
    _assert_bitwise_equal(out, batchnorm_reference)


def test_a_frozen_rank_is_lost_too_and_the_ranks_left_save_the_step_it_reached(reference, tmp_path):
    out = tmp_path / "run"
    done = _killed(tmp_path, "--out", str(out), "--timeout", "5", rank=1, step=17, when="STOP_AFTER_POST")
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.startswith("phalanx: run stopped: worker rank 1 stopped responding (state: stopped) after "
                                  "step 17"), done.stderr[-3000:]
    assert re.search(r"the run was saved where it stopped: \S+checkpoint\.pt \(epoch 1, step 17, saved by rank 0 "
                     r"when rank 1 was lost\)", done.stderr), done.stderr[-3000:]
    resumed = run_phalanx(*COMMON, *TWO, "--out", str(out), "--resume", "auto")
    assert resumed.returncode == 0 and "at epoch 1, step 17" in resumed.stdout, resumed.stderr[-3000:]
    _assert_bitwise_equal(out, reference)


def test_when_rank_0_fails_with_an_error_of_its_own_rank_1_saves(reference, tmp_path):
    # Rank 0 raised (its process lives on a moment, its board line says FAILED): it saves nothing,
    # its error not being a lost peer's; rank 1, the lowest rank left, does.
    out = tmp_path / "run"
    done = _killed(tmp_path, "--out", str(out), rank=0, step=17, when="RAISE_AFTER_POST")
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.startswith("phalanx: worker rank 0 failed: OSError: the injected error"), done.stderr[-3000:]
    assert re.search(r"the run was saved where it stopped: \S+checkpoint\.pt \(epoch 1, step 17, saved by rank 1 "
                     r"when rank 0 was lost\)", done.stderr), done.stderr[-3000:]
    resumed = run_phalanx(*COMMON, *TWO, "--out", str(out), "--resume", "auto")
    assert resumed.returncode == 0 and "at epoch 1, step 17" in resumed.stdout, resumed.stderr[-3000:]
    _assert_bitwise_equal(out, reference)
