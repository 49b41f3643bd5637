"""`phalanx run --log-dir DIR [--redirects N] [--tee N]` keeps each worker's output in files of its own,
as torchrun's three flags do (runtime/worker_logs.py): DIR/attempt_<n>/<rank>/stdout.log and stderr.log,
the tee'd lines on the console after "[rank N]: ", the redirected ones in the files only, what a worker
printed just before it was killed outright still on the console, a restart's output under attempt_1,
and --local-ranks-filter keeping the console to its ranks while every rank writes its files. Before
2026-12-07 the flags were refused in one line."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = textwrap.dedent("""
    import os, signal, subprocess, sys
    import phalanx
    world = phalanx.init()
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    print(f"rank {world.rank} says hello in attempt {attempt}", flush=True)
    print(f"rank {world.rank} warns", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-c", f"print('child of rank {world.rank}')"], check=True)
    phalanx.barrier(world=world)
    if sys.argv[1:] == ["die"] and world.rank == 1 and attempt == "0":
        print("rank 1's last words", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    phalanx.barrier(world=world)
""")
PHALANX_RUN = [sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", "--threads-per-device", "1",
               "--timeout", "30", "--quiet"]


def _run(tmp_path: Path, *flags: str, script_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    script = tmp_path / "talk.py"
    script.write_text(SCRIPT)
    return subprocess.run([*PHALANX_RUN, *flags, str(script), *script_args], capture_output=True, text=True,
                          timeout=180, cwd=tmp_path, env=dict(os.environ))


def _read(logs: Path, attempt: int, rank: int, stream: str) -> list[str]:
    return (logs / f"attempt_{attempt}" / str(rank) / f"{stream}.log").read_text().splitlines()


def test_log_dir_alone_tees_both_streams_of_every_rank(tmp_path):
    done = _run(tmp_path, "--log-dir", "logs")
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert _read(tmp_path / "logs", 0, rank, "stdout") == [f"rank {rank} says hello in attempt 0",
                                                              f"child of rank {rank}"]
        assert _read(tmp_path / "logs", 0, rank, "stderr") == [f"rank {rank} warns"]
    assert sorted(done.stdout.splitlines()) == ["[rank 0]: child of rank 0", "[rank 0]: rank 0 says hello in attempt 0",
                                                "[rank 1]: child of rank 1", "[rank 1]: rank 1 says hello in attempt 0"]
    assert sorted(done.stderr.splitlines()) == ["[rank 0]: rank 0 warns", "[rank 1]: rank 1 warns"]


def test_redirected_streams_reach_the_files_only(tmp_path):
    done = _run(tmp_path, "--log-dir", "logs", "--redirects", "1", "--tee", "0:2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == ""
    assert sorted(done.stderr.splitlines()) == ["[rank 0]: rank 0 warns", "rank 1 warns"]  # rank 1's: not in the map
    assert _read(tmp_path / "logs", 0, 1, "stdout") == ["rank 1 says hello in attempt 0", "child of rank 1"]
    assert not (tmp_path / "logs" / "attempt_0" / "1" / "stderr.log").exists()


def test_a_killed_workers_last_line_and_a_restarts_attempt(tmp_path):
    done = _run(tmp_path, "--log-dir", "logs", "--max-restarts", "1", script_args=("die",))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[rank 1]: rank 1's last words" in done.stdout.splitlines(), done.stdout
    assert _read(tmp_path / "logs", 0, 1, "stdout")[-1] == "rank 1's last words"
    assert _read(tmp_path / "logs", 1, 1, "stdout")[0] == "rank 1 says hello in attempt 1"


def test_the_ranks_filter_keeps_the_console_to_its_ranks_and_every_rank_writes_its_files(tmp_path):
    done = _run(tmp_path, "--log-dir", "logs", "--local-ranks-filter", "0")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(done.stdout.splitlines()) == ["[rank 0]: child of rank 0", "[rank 0]: rank 0 says hello in attempt 0"]
    assert _read(tmp_path / "logs", 0, 1, "stdout") == ["rank 1 says hello in attempt 0", "child of rank 1"]


def test_under_torchrun_the_flags_are_torchruns(tmp_path):
    script = tmp_path / "talk.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m",
                           "phalanx", "run", "--log-dir", "logs", str(script)], capture_output=True, text=True,
                          timeout=180, cwd=tmp_path)
    assert done.returncode != 0
    assert ("phalanx: error: under torchrun, restarts and worker logs are torchrun's: pass --max-restarts and "
            "--log-dir to torchrun, not to phalanx run") in done.stderr, done.stderr[-3000:]
