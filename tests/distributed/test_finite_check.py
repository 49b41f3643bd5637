"""A NaN on one rank under `phalanx run`: the allreduce spreads it to every
replica, and DataParallel's finite check stops the run within its interval in one line naming
the step and the rank it came from - sharded too (each rank then sums its own range only); with
the check off the script ends 0 and saves NaN weights. A NaN after the last periodic check (or in
a run shorter than the interval, at the default check every 100 steps) is caught before the state
leaves the replica - full_state_dict, rank 0's state_dict alone, phalanx.checkpoint, close - and
`phalanx train` checks at every epoch's end: nothing non-finite is written."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parent / "scripts" / "nan_on_one_rank.py"


def _run(out: Path, *args: str, nan_step: int = 3) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", "--timeout", "60", "--quiet",
                           str(SCRIPT), "--nan-step", str(nan_step), "--nan-rank", "1", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("shard", ["none", "gradients"])
def test_a_nan_on_one_rank_is_named_by_step_and_rank_within_the_check_interval(tmp_path, shard):
    done = _run(tmp_path, "--check-every", "5", "--shard", shard)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        "phalanx: run stopped: gradient NaN/Inf at step 3: rank 1's own gradient went non-finite first and the "
        "allreduce spread it to every replica (found at step 5's check, every 5 steps); look at that step's loss "
        "and data, or lower the lr; check_finite_every=0 turns this check off"]
    assert not (tmp_path / "model.pt").exists()


def test_with_the_check_off_the_nan_goes_unnoticed(tmp_path):
    done = _run(tmp_path, "--check-every", "0")
    assert done.returncode == 0, done.stderr[-2000:]
    weights = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(t.isnan().all() for t in weights.values())  # what the check is there to prevent


@pytest.mark.parametrize("leave, found, shard, steps, nan_step", [
    ("full_state_dict", "full_state_dict()", "parameters", 30, 5),
    ("full_state_dict", "full_state_dict()", "parameters", 150, 120),
    ("checkpoint", "phalanx.checkpoint()", "optimizer", 30, 5), ("close", "close()", "none", 30, 5)])
def test_a_nan_after_the_last_check_is_named_before_the_state_leaves(tmp_path, leave, found, shard, steps, nan_step):
    done = _run(tmp_path, "--check-every", "100", "--shard", shard, "--steps", str(steps), "--leave", leave,
                nan_step=nan_step)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        f"phalanx: run stopped: gradient NaN/Inf at step {nan_step}: rank 1's own gradient went non-finite first and "
        f"the allreduce spread it to every replica (found by {found} after step {steps}, before the next check every "
        "100 steps); look at that step's loss and data, or lower the lr; check_finite_every=0 turns this check off"], \
        done.stderr[-2000:]
    assert not (tmp_path / "model.pt").exists() and not (tmp_path / "checkpoints").exists()


def test_rank_0s_state_dict_alone_names_the_step_from_its_own_notes(tmp_path):
    done = _run(tmp_path, "--check-every", "100", "--steps", "30", "--leave", "state_dict", nan_step=5)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[0] == (
        "phalanx: run stopped: gradient NaN/Inf at step 5: rank 1's own gradient went non-finite (or the sum "
        "overflowed) while rank 0's stayed finite (found by state_dict() after step 30, before the next check every "
        "100 steps); look at that step's loss and data, or lower the lr; check_finite_every=0 turns this check off")
    assert not (tmp_path / "model.pt").exists()


# A driver script: rank 1's first parameter gets a NaN gradient at the epoch's last step (24 of
# synthetic's 24), which its loss does not show: only the gradient check can see it.
NAN_GRADIENT_AT_EPOCH_END = textwrap.dedent("""
    import os
    from phalanx.job import job
    real_build = job.build_strategy
    def build_with_a_nan(config, model, *, world, **kw):
        strategy = real_build(config, model, world=world, **kw)
        if world.rank == 1:
            seen = [0]
            def poison(grad):
                seen[0] += 1
                return grad * float("nan") if seen[0] == 24 else grad
            next(strategy.module.parameters()).register_hook(poison)
        return strategy
    job.build_strategy = build_with_a_nan
    if __name__ == "__main__":
        import sys
        from phalanx.cli import main
        sys.exit(main(sys.argv[1:]))
""")


def test_phalanx_train_checks_at_the_epochs_end_before_its_row_and_checkpoint(tmp_path):
    driver = tmp_path / "nan_at_epoch_end.py"
    driver.write_text(NAN_GRADIENT_AT_EPOCH_END)
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, str(driver), "train", "--devices", "cpu:2", "--dataset", "synthetic",
                           "--epochs", "1", "--no-progress", "--threads-per-device", "1", "--checkpoint-every", "epoch",
                           "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "phalanx: run stopped: gradient NaN/Inf at step 24: rank 1's own gradient went non-finite first and the "
        "allreduce spread it to every replica (found by the end of epoch 1 after step 24, before the next check every "
        "100 steps); look at that step's loss and data, or lower the lr; check_finite_every=0 turns this check off"), \
        done.stderr[-2000:]
    assert not (out / "model.pt").exists() and not (out / "metrics.jsonl").exists()
    assert not (out / "checkpoints" / "checkpoint.pt").exists()
