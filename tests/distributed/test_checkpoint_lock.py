"""One job per checkpoint location (file_lock.py) under `phalanx run`: a second job given a
location a running job checkpoints to stops in one line naming the first job's rank 0, exit 2,
before writing anything, and the first job's checkpoint is left as it was (two jobs on one
location used to write it in turn, and a restart of either resumed from the other's state,
silently). A job restarted after its rank 0 was killed holding the lock takes it again at once,
and once the first job ends the location is free: a new job resumes from its checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""\
    import os
    import sys
    import time

    import torch
    import torch.nn.functional as F
    from torch import nn

    import phalanx

    checkpoints, epochs, crash_after, ready, go = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    world = phalanx.init()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    dp = phalanx.prepare(nn.Linear(6, 3), world=world, dtype=torch.float64)
    optimizer = torch.optim.SGD(dp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(48, 6, generator=g, dtype=torch.float64),
                                          torch.randint(0, 3, (48,), generator=g))
    loader = phalanx.ShardedLoader(data, world=world, global_batch_size=12, seed=0)
    start = phalanx.resume(checkpoints, world=world, model=dp, optimizer=optimizer, global_batch_size=12, seed=0)
    for epoch in range(start.epoch, epochs):
        for (x, y), size in loader.epoch(epoch):
            dp.zero_grad()
            phalanx.shard_loss(F.cross_entropy(dp(x), y, reduction="sum"), size).backward()
            dp.finish_gradient_sync()
            optimizer.step()
        phalanx.checkpoint(checkpoints, world=world, model=dp, optimizer=optimizer, epoch=epoch + 1,
                           global_batch_size=12, seed=0)
        if epoch + 1 == crash_after and world.rank == 0 and attempt == 0:
            os._exit(3)  # killed holding the lock
    if world.rank == 0:
        print(f"attempt {attempt} went on from epoch {start.epoch}", flush=True)
        if ready != "-":
            with open(ready + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(ready + ".tmp", ready)
            deadline = time.monotonic() + 120
            while not os.path.exists(go) and time.monotonic() < deadline:
                time.sleep(0.05)
    dp.close()
""")


def _command(tmp_path: Path, checkpoints: Path, *, epochs: int, crash_after: int = 0, ready: str = "-",
             restarts: int = 0) -> list[str]:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    return [sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", "--quiet", "--timeout", "60",
            "--max-restarts", str(restarts), str(script), str(checkpoints), str(epochs), str(crash_after), ready,
            str(tmp_path / "go")]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def test_a_second_job_on_a_running_jobs_checkpoint_stops_in_one_line_and_the_first_keeps_its_work(tmp_path):
    checkpoints, ready = tmp_path / "checkpoints", tmp_path / "ready"
    first = subprocess.Popen(_command(tmp_path, checkpoints, epochs=2, ready=str(ready)), env=_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not ready.exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate(timeout=30)
            time.sleep(0.1)
        holder = int(ready.read_text())
        saved = (checkpoints / "checkpoint.pt").read_bytes()
        second = subprocess.run(_command(tmp_path, checkpoints, epochs=4), env=_env(), capture_output=True,
                                text=True, timeout=180)
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert lines == [f"phalanx: error: {tmp_path / 'job.py'}:21: phalanx.resume: {checkpoints / 'checkpoint.pt'} is the "
                         f"checkpoint of another job (pid {holder}, its rank 0), and two jobs writing one checkpoint "
                         "resume from each other's; wait for that job to end, or give this one another location"]
        assert (checkpoints / "checkpoint.pt").read_bytes() == saved
        assert first.poll() is None  # the first job never noticed
    finally:
        (tmp_path / "go").touch()
        out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert "attempt 0 went on from epoch 0" in out
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint.previous.pt", "checkpoint.pt"]  # no lock file left
    later = subprocess.run(_command(tmp_path, checkpoints, epochs=3), env=_env(), capture_output=True, text=True,
                           timeout=180)
    assert later.returncode == 0, later.stderr
    assert "attempt 0 went on from epoch 2" in later.stdout


def test_a_restart_takes_the_lock_its_killed_rank_0_held(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    run = subprocess.run(_command(tmp_path, checkpoints, epochs=3, crash_after=1, restarts=1), env=_env(),
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    assert "attempt 1 went on from epoch 1" in run.stdout
    assert "restart 1 of 1" in run.stderr
