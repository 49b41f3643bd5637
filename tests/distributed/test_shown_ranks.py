"""`phalanx run --local-ranks-filter R,...` shows the listed local ranks' stdout and stderr alone, as
torchrun's flag does (runtime/shown_ranks.py): the other ranks' prints, their warnings and what their
child processes print go to /dev/null, while the launcher's lines stay and a failing rank that is not
shown is still named with its traceback. Under torchrun (`torchrun ... -m phalanx run --local-ranks-filter
0 script.py`) each worker applies it to itself. Before 2026-12-07 the flag was refused in one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = textwrap.dedent("""
    import subprocess, sys
    import phalanx
    world = phalanx.init()
    print(f"rank {world.rank} says hello", flush=True)
    print(f"rank {world.rank} warns", file=sys.stderr, flush=True)
    # one write, so that a line of another process cannot land inside it (PYTHONUNBUFFERED splits a print in two)
    subprocess.run([sys.executable, "-c", f"import os; os.write(1, b'child of rank {world.rank}' + bytes([10]))"],
                   check=True)
    phalanx.barrier(world=world)
    if len(sys.argv) > 1 and world.rank == int(sys.argv[1]):
        raise ValueError(f"rank {world.rank} broke")
    phalanx.barrier(world=world)
""")


def _run(tmp_path: Path, *launcher: str, fail_on: str | None = None) -> subprocess.CompletedProcess:
    script = tmp_path / "talk.py"
    script.write_text(SCRIPT)
    return subprocess.run([*launcher, str(script), *([fail_on] if fail_on is not None else [])], capture_output=True,
                          text=True, timeout=180, cwd=tmp_path, env=dict(os.environ))


PHALANX_RUN = [sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", "--threads-per-device", "1",
               "--timeout", "30"]


def test_only_the_listed_ranks_output_reaches_the_console(tmp_path):
    done = _run(tmp_path, *PHALANX_RUN, "--local-ranks-filter", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["rank 1 says hello", "child of rank 1"]
    assert "rank 1 warns" in done.stderr and "rank 0" not in done.stderr
    assert done.stderr.startswith("phalanx run: 2 workers on cpu")  # the launcher's own line stays
    every = _run(tmp_path, *PHALANX_RUN)  # without the flag, both ranks, as before
    assert sorted(every.stdout.splitlines()) == ["child of rank 0", "child of rank 1", "rank 0 says hello",
                                                 "rank 1 says hello"]


def test_a_failing_rank_that_is_not_shown_is_still_named_with_its_traceback(tmp_path):
    done = _run(tmp_path, *PHALANX_RUN, "--local-ranks-filter", "1", fail_on="0")
    assert done.returncode == 1
    assert "phalanx: worker rank 0 failed: ValueError: rank 0 broke" in done.stderr
    assert 'raise ValueError(f"rank {world.rank} broke")' in done.stderr  # its traceback, through its report
    assert "rank 0 says hello" not in done.stdout


def test_under_torchrun_each_worker_filters_itself(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    assert torchrun, "torchrun ships with torch and must be on PATH"
    done = _run(tmp_path, torchrun, "--standalone", "--nproc-per-node", "2", "-m", "phalanx", "run",
                "--local-ranks-filter", "0", "--timeout", "30")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(done.stdout.splitlines()) == ["child of rank 0", "rank 0 says hello"]
