"""`phalanx run --max-restarts N` and `phalanx.launch(..., max_restarts=N)`, as torchrun's
--max-restarts: after a worker fails, every worker starts again (TORCHELASTIC_RESTART_COUNT says
which attempt), and a script that checkpoints each epoch with `phalanx.checkpoint` and starts with
`phalanx.resume` ends bitwise equal to the run nothing interrupted (2 CPU workers, float64, Adam).
Each restart is one line naming the rank and what happened, then that rank's traceback where it
raised; past N restarts the failure is the run's; bad input is not restarted."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import phalanx

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""\
    import os
    import sys

    import torch
    import torch.nn.functional as F
    from torch import nn

    import phalanx


    def main(checkpoints, out, crash_epoch, crashes):
        world = phalanx.init()
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        torch.manual_seed(0)
        dp = phalanx.prepare(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)), world=world,
                             dtype=torch.float64)
        optimizer = torch.optim.Adam(dp.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(120, 6, generator=g, dtype=torch.float64),
                                              torch.randint(0, 3, (120,), generator=g))
        loader = phalanx.ShardedLoader(data, world=world, global_batch_size=24, seed=0)
        start = phalanx.resume(checkpoints, world=world, model=dp, optimizer=optimizer, global_batch_size=24, seed=0)
        for epoch in range(start.epoch, 4):
            if epoch == crash_epoch and world.rank == 1 and attempt < crashes:
                os._exit(3)
            for (x, y), size in loader.epoch(epoch):
                dp.zero_grad()
                phalanx.shard_loss(F.cross_entropy(dp(x), y, reduction="sum"), size).backward()
                dp.finish_gradient_sync()
                optimizer.step()
            phalanx.checkpoint(checkpoints, world=world, model=dp, optimizer=optimizer, epoch=epoch + 1,
                               global_batch_size=24, seed=0)
        if world.rank == 0:
            torch.save(dp.module.state_dict(), out)
            print(f"attempt {attempt} went on from epoch {start.epoch}", flush=True)
        dp.close()
        return attempt


    if __name__ == "__main__":
        main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
""")


def _run(tmp_path: Path, name: str, *, crash_epoch: int, crashes: int, restarts: int) -> subprocess.CompletedProcess:
    script = tmp_path / "restartable.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", "--quiet", "--timeout", "60",
                           "--max-restarts", str(restarts), str(script), str(tmp_path / f"{name}-checkpoints"),
                           str(tmp_path / f"{name}.pt"), str(crash_epoch), str(crashes)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})


def _restart_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("phalanx run: worker rank")]


def test_a_restarted_script_resumes_and_ends_as_the_uninterrupted_run(tmp_path):
    whole = _run(tmp_path, "whole", crash_epoch=-1, crashes=0, restarts=0)
    assert whole.returncode == 0, whole.stderr[-3000:]
    restarted = _run(tmp_path, "restarted", crash_epoch=2, crashes=1, restarts=2)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert restarted.stdout.strip() == "attempt 1 went on from epoch 2", restarted.stdout
    assert _restart_lines(restarted.stderr) == [
        "phalanx run: worker rank 1 (cpu:1) exited with code 3 without a result after step 10; restart 1 of 2: every "
        "worker starts again (TORCHELASTIC_RESTART_COUNT=1)"], restarted.stderr
    want, got = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "restarted.pt")
    assert all(torch.equal(got[key], want[key]) for key in want)


KILLED_MID_WRITE = textwrap.dedent("""\
    import os, signal, sys
    import torch
    import phalanx

    world = phalanx.init()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    start = phalanx.resume(sys.argv[1], world=world, model=model, optimizer=optimizer, global_batch_size=8, seed=0)
    for epoch in range(start.epoch, 3):
        if attempt == 0 and epoch == 1 and world.rank == 0:  # killed with the bytes written, before the rename
            os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
        phalanx.checkpoint(sys.argv[1], world=world, model=model, optimizer=optimizer, epoch=epoch + 1,
                           global_batch_size=8, seed=0)
""")


def test_a_write_cut_short_by_a_kill_leaves_nothing_once_resumed(tmp_path):
    # Rank 0 SIGKILLed inside phalanx.checkpoint left its temporary file (the whole checkpoint's
    # size) in the script's directory for good: no run holds a lock there to sweep it.
    script, checkpoints = tmp_path / "killed.py", tmp_path / "checkpoints"
    script.write_text(KILLED_MID_WRITE)
    done = subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", "--quiet", "--timeout", "60",
                           "--max-restarts", "1", str(script), str(checkpoints)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "worker rank 0 (cpu:0) died (signal SIGKILL)" in done.stderr, done.stderr[-3000:]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint.previous.pt", "checkpoint.pt"]


def test_past_its_restarts_the_failure_is_the_run_s(tmp_path):
    done = _run(tmp_path, "spent", crash_epoch=1, crashes=5, restarts=1)
    assert done.returncode == 1
    assert len(_restart_lines(done.stderr)) == 1, done.stderr
    assert "phalanx: worker rank 1 failed: exited with code 3 without a result" in done.stderr


def _attempt_twice(checkpoints: str) -> int:
    world = phalanx.init()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt == 0 and world.rank == 0:
        raise ValueError("the first attempt's fault")
    phalanx.barrier(world=world)
    return attempt


def _bad_input() -> None:
    raise phalanx.UsageError("bad input, not worth a restart")


def test_launch_restarts_a_function_and_not_bad_input(capfd):
    assert phalanx.launch(_attempt_twice, "unused", devices="cpu:2", max_restarts=1, timeout_s=60, quiet=True) == [1, 1]
    said = capfd.readouterr().err
    line = ("phalanx.launch: worker rank 0 (cpu:0) ValueError: the first attempt's fault; restart 1 of 1: every "
            "worker starts again (TORCHELASTIC_RESTART_COUNT=1)")
    assert line in said
    # Then the rank's traceback, as the run's end would show it: a restart does not hide why it came.
    shown = said.split(line + "\n", 1)[1].splitlines()
    assert shown[:2] == ["--- rank 0 ---", "Traceback (most recent call last):"], said
    assert "in _attempt_twice" in said and shown.index("ValueError: the first attempt's fault") > 2, said
    with pytest.raises(phalanx.UsageError, match="^bad input, not worth a restart$"):
        phalanx.launch(_bad_input, devices="cpu:2", max_restarts=3, timeout_s=60, quiet=True)
    assert "restart" not in capfd.readouterr().err
