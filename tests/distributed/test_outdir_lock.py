"""Two runs started 0.5 s apart on one --out, end to end: they must not both "succeed" with one's
files silently replacing the other's. The second stops in one line naming the first's
pid (exit 2) and writes nothing; the first finishes whole. A later plain run on that --out is
refused (it would overwrite a finished run); `--resume auto` continues the first run and says
what changed; `--overwrite` starts afresh. The model.pt of a run whose disk is full (the atomic
write patched to raise ENOSPC in every worker) is named where it is kept: exit 1, one line.

The lock itself (dirlock.py) against a real second process holding it: refused in one line
naming the holder's pid, the checkpoint directory locked too, nothing left behind by a SIGKILLed
holder, no lock where none is asked for. Its in-process rules are tests/unit/test_dirlock.py's."""

import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from phalanx.errors import UsageError
from phalanx.job.dirlock import PID_FILE, hold_run_directories
from tests.distributed.runs import finish, metrics_rows, start_phalanx
from tests.unit.test_dirlock import _config

pytestmark = pytest.mark.distributed

BASE = ["train", "--devices", "2", "--dataset", "synthetic", "--no-progress", "--threads-per-device", "1",
        "--checkpoint-every", "5"]


def test_two_runs_on_one_out_dir_one_is_refused_naming_the_other(tmp_path):
    out = tmp_path / "S"
    first = start_phalanx(*BASE, "--epochs", "4", "--lr", "0.2", "--out", str(out))
    time.sleep(0.5)  # as in the issue: the second starts while the first is starting up
    second = start_phalanx(*BASE, "--epochs", "2", "--lr", "0.05", "--out", str(out))
    results = {proc.pid: finish(proc) for proc in (first, second)}
    codes = sorted(code for code, _, _ in results.values())
    assert codes == [0, 2], {pid: (code, err[-1500:]) for pid, (code, _, err) in results.items()}
    winner = next(pid for pid, (code, _, _) in results.items() if code == 0)
    loser_err = next(err for code, _, err in results.values() if code == 2)
    assert loser_err.strip() == (f"phalanx: error: --out {out} is in use by another phalanx run (pid {winner}); "
                                 "wait for it to end or pick another directory")
    lr = 0.2 if winner == first.pid else 0.05
    rows = metrics_rows(out)
    assert [r["epoch"] for r in rows] == list(range(1, len(rows) + 1)) and {r["lr"] for r in rows} == {lr}
    assert sorted(p.name for p in out.iterdir()) == ["accuracy.png", "checkpoints", "metrics.jsonl", "model.pt"]

    # A later plain run would overwrite that finished run: refused, naming both ways on.
    code, _, err = finish(start_phalanx(*BASE, "--epochs", "6", "--lr", "0.05", "--out", str(out)))
    assert code == 2 and err.strip() == (
        f"phalanx: error: --out {out} holds an earlier run's outputs (metrics.jsonl, accuracy.png, model.pt, "
        "checkpoints/checkpoint.pt); continue that run with --resume auto, or replace them with --overwrite")
    # Continuing it says what changed since its checkpoint.
    epochs = len(rows)
    code, stdout, err = finish(start_phalanx(*BASE, "--epochs", str(epochs + 1), "--lr", "0.07", "--out", str(out),
                                             "--resume", "auto"))
    assert code == 0, err[-2000:]
    assert stdout.splitlines()[0] == (f"resumed from {out / 'checkpoints' / 'checkpoint.pt'} at epoch {epochs + 1}, "
                                      f"step 0; changed since the checkpoint: --lr {lr:g} -> 0.07, "
                                      f"--epochs {epochs} -> {epochs + 1}")
    assert [r["lr"] for r in metrics_rows(out)] == [lr] * epochs + [0.07]
    # --overwrite starts afresh: the earlier rows are gone, not mixed in.
    code, _, err = finish(start_phalanx(*BASE, "--epochs", "1", "--lr", "0.07", "--out", str(out), "--overwrite"))
    assert code == 0, err[-2000:]
    assert [(r["epoch"], r["lr"]) for r in metrics_rows(out)] == [(1, 0.07)]
    assert torch.load(out / "checkpoints" / "checkpoint.pt", weights_only=True)["epoch"] == 1


FULL_DISK = textwrap.dedent("""
    import errno, os
    from phalanx.job import outputs
    real_write = outputs.atomic_write_bytes
    def write(path, data):  # model.pt meets a full disk; everything else is written
        if os.path.basename(path) == "model.pt":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_write(path, data)
    outputs.atomic_write_bytes = write
    if __name__ == "__main__":
        import sys
        from phalanx.cli import main
        sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.parametrize("devices", ["1", "2"])
def test_a_model_pt_that_does_not_fit_names_the_checkpoint_that_holds_the_weights(tmp_path, devices):
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK)
    out = tmp_path / "run"
    argv = [a if a != "2" else devices for a in BASE]  # --devices 1 runs in the launcher itself
    code, stdout, stderr = finish(start_phalanx(*argv, "--epochs", "1", "--dtype", "float64", "--out", str(out),
                                                script=script))
    kept = out / "checkpoints" / "checkpoint.pt"
    assert code == 1, stderr[-2000:]
    assert stderr.strip() == (f"phalanx: run stopped: cannot write {out / 'model.pt'} (No space left on device); "
                              f"the trained model is in the last checkpoint, {kept} (its 'model' entry is the state "
                              "dict model.pt would hold)"), stderr[-2000:]
    assert not (out / "model.pt").exists()
    assert re.search(r"^epoch   1 ", stdout, re.M)
    state = torch.load(kept, weights_only=True)
    assert (state["epoch"], state["step"]) == (1, 0)  # the end of the last epoch: the trained model


HOLD_S = 60  # the child gives up holding after this long, whatever the test does


def _holder(**config) -> subprocess.Popen:
    """A process holding the run directories of _config(**config) until its stdin closes."""
    script = textwrap.dedent(f"""
        import pickle, sys, select
        from phalanx.job.dirlock import hold_run_directories
        with hold_run_directories(pickle.loads(bytes.fromhex({pickle.dumps(_config(**config)).hex()!r}))):
            print("held", flush=True)
            select.select([sys.stdin], [], [], {HOLD_S})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.stdin.close()
        proc.wait(timeout=30)


def test_a_held_out_dir_is_refused_in_one_line_naming_the_holder(tmp_path):
    out = tmp_path / "S"
    holder = _holder(out_dir=str(out))
    try:
        with pytest.raises(UsageError) as info:
            with hold_run_directories(_config(out_dir=str(out))):
                pytest.fail("a second run got the lock")
        assert str(info.value) == (f"--out {out} is in use by another phalanx run (pid {holder.pid}); "
                                   "wait for it to end or pick another directory")
    finally:
        _end(holder)
    assert holder.returncode == 0
    assert not (out / PID_FILE).exists() and not out.exists()  # made only to be locked: removed again
    with hold_run_directories(_config(out_dir=str(out))):  # free once the holder is done
        assert (out / PID_FILE).read_text().strip() == str(os.getpid())


def test_a_killed_holder_leaves_no_lock_behind(tmp_path):
    out = tmp_path / "S"
    holder = _holder(out_dir=str(out))
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=30)
    assert (out / PID_FILE).exists()  # stale: it could not clean up, and need not
    with hold_run_directories(_config(out_dir=str(out))):
        assert (out / PID_FILE).read_text().strip() == str(os.getpid())
    assert not (out / PID_FILE).exists()


def test_the_checkpoint_dir_is_locked_too(tmp_path):
    shared = tmp_path / "ckpt"
    holder = _holder(out_dir=str(tmp_path / "a"), checkpoint_dir=str(shared), checkpoint_every="5")
    try:
        with pytest.raises(UsageError, match=rf"^--checkpoint-dir {shared} is in use by another phalanx run "
                                             rf"\(pid {holder.pid}\)"):
            with hold_run_directories(_config(out_dir=str(tmp_path / "b"), checkpoint_dir=str(shared),
                                                  checkpoint_every="epoch")):
                pass
    finally:
        _end(holder)
    assert not (tmp_path / "b").exists(), "a refused run must leave nothing"


def test_no_lock_where_none_is_asked_for(tmp_path):
    out = tmp_path / "S"
    holder = _holder(out_dir=str(out))
    try:
        with hold_run_directories(_config(out_dir=str(out)), enabled=False):  # a torchrun rank > 0
            pass
    finally:
        _end(holder)
