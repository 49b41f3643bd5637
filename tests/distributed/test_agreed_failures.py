"""A checkpoint write that fails on one rank raises on every rank (comm/agreed.py), under `phalanx
run`: a script that catches it (`except OSError:`, to go on when a disk is full) goes on in step,
and its next checkpoint is whole. Before 2026-12-06 only the failing rank raised; the others waited
in the checkpoint's barrier, and the run stopped at rank 0's next step with "ranks are in
different collectives". Replicated (rank 0 writes) and ZeRO-3 (each rank writes its share, then
rank 0 the manifest: a failed save's shares are removed, not left to fill the disk). So does
`main_first`'s block failing on the first rank (a failed download): the others raise it without
running theirs, and a script that falls back goes on in step."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from phalanx.train.checkpoint import read_checkpoint
from phalanx.train.sharded_checkpoint import share_files
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

# Writes fail with ENOSPC on rank FAILING_RANK for the checkpoints of steps 1 and 2 (at the fsync
# of the file's bytes, as a full disk does); step 3's is written.
SCRIPT = textwrap.dedent("""\
    import errno, os, sys
    import torch, torch.nn.functional as F
    import phalanx

    location, shard, failing_rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    world = phalanx.init()
    failing = {"now": False}
    real_fsync = os.fsync
    def fsync(fd):
        if failing["now"] and world.rank == failing_rank:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)
    os.fsync = fsync
    torch.manual_seed(0)
    dp = phalanx.prepare(torch.nn.Linear(10, 2), world=world, dtype=torch.float64,
                         **({"shard": "parameters"} if shard == "zero3" else {}))
    optimizer = dp.optimizer(torch.optim.SGD, lr=0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 10, generator=g, dtype=torch.float64), torch.randint(0, 2, (64,), generator=g)
    mine = slice(world.rank * 32, world.rank * 32 + 32)
    for step in range(1, 4):
        optimizer.zero_grad()
        phalanx.shard_loss(F.cross_entropy(dp(x[mine]), y[mine], reduction="sum"), 64).backward()
        dp.finish_gradient_sync()
        optimizer.step()
        failing["now"] = step < 3
        try:
            phalanx.checkpoint(location, world=world, model=dp, optimizer=optimizer, epoch=0, step=step,
                               global_batch_size=64, seed=0)
            print(f"rank {world.rank} saved step {step}", flush=True)
        except OSError as exc:
            print(f"rank {world.rank} step {step}: {type(exc).__name__}: {exc}", flush=True)
    print(f"rank {world.rank} done", flush=True)
""")


@pytest.mark.parametrize("shard, failing_rank", [("replicated", 0), ("zero3", 1), ("zero3", 0)])
def test_a_failed_write_raises_on_every_rank_and_a_caught_one_goes_on(tmp_path, shard, failing_rank):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    location = tmp_path / "ck"
    run = subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", "--timeout", "30",
                          str(script), str(location), shard, str(failing_rank)],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = set(run.stdout.splitlines())
    for rank in (0, 1):
        for step in (1, 2):  # the same error on both ranks: the failing rank's own, the other told
            failed = [line for line in lines if line.startswith(f"rank {rank} step {step}: ")]
            assert len(failed) == 1 and "WriteFailed: cannot write" in failed[0], run.stdout
            assert "(No space left on device); free space there or choose another directory" in failed[0]
        assert {f"rank {rank} saved step 3", f"rank {rank} done"} <= lines, run.stdout
    assert read_checkpoint(location)["step"] == 3
    if shard == "zero3":  # the failed saves' shares were removed; only step 3's (and nothing older) are left
        assert len(share_files(location)) == 2, sorted(p.name for p in location.iterdir())


def test_uncaught_the_run_stops_on_the_failing_ranks_one_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace("except OSError as exc:", "except ZeroDivisionError as exc:"))
    run = subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", "--timeout", "30",
                          str(script), str(tmp_path / "ck"), "replicated", "0"],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 1, run.stderr[-3000:]
    stopped = [line for line in run.stderr.splitlines() if line.startswith("phalanx: ")]
    assert stopped == [f"phalanx: run stopped: cannot write {tmp_path / 'ck' / 'checkpoint.pt'} (No space left on "
                       "device); free space there or choose another directory"], run.stderr[-3000:]
    assert "different collectives" not in run.stderr


def _download_fails_on_rank_0(world, per_host: bool) -> tuple[list[int], str, float]:
    import phalanx

    ran = []
    try:
        with phalanx.main_first(world=world, per_host=per_host):
            ran.append(world.rank)
            if world.rank == 0:
                raise ConnectionError("download failed: connection reset")
    except OSError as exc:  # the script's fallback (a local copy), on every rank alike
        told = f"{type(exc).__name__}: {exc}"
    return ran, told, phalanx.reduce(float(world.rank), world=world, op="sum")


@pytest.mark.parametrize("per_host", [False, True])
def test_a_failed_main_first_block_raises_on_every_rank_and_the_others_skip_theirs(per_host):
    # Before 2026-12-06 the other ranks ran their block and waited in a barrier rank 0 never reached.
    results = run_workers(_download_fails_on_rank_0, 3, per_host, timeout_s=60)
    assert [ran for ran, _, _ in results] == [[0], [], []]
    assert {told for _, told, _ in results} == {"ConnectionError: download failed: connection reset"}
    assert [total for _, _, total in results] == [3.0, 3.0, 3.0]  # in step after it: the next collective pairs
