"""`phalanx run` of a script that names its own rendezvous (torch's DDP tutorial's MASTER_ADDR and
MASTER_PORT lines, an init_method="tcp://...", a MASTER_PORT set before phalanx.init()): each joins
the launcher's store, and rank 0 says once at the script's line what to drop so that the script runs
under torchrun too (runtime/own_rendezvous.py). Before 2026-12-07 every rank waited for a store no
one hosted, and failed with torch's traceback after 3 min 31 s under `--timeout 120` (28 s here, under
`--timeout 20`); torchrun waits alike. A world_size= other than the workers started is one line at once
(it was --timeout, then a traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parent / "scripts" / "own_rendezvous.py"


def _run(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", "--threads-per-device", "1",
                           "--timeout", "20", str(SCRIPT), mode], capture_output=True, text=True, timeout=90,
                          env=dict(os.environ))


@pytest.mark.parametrize("mode, how", [("env", "(MASTER_ADDR and MASTER_PORT set by the script)"),
                                       ("tcp", "(init_method='tcp://localhost:23456')"),
                                       ("init", "(MASTER_ADDR and MASTER_PORT set by the script)")])
def test_a_scripts_own_rendezvous_joins_the_launchers_store_said_once_at_its_line(mode, how):
    done = _run(mode)
    assert done.returncode == 0, done.stderr[-3000:]
    launcher_port = done.stderr.split("phalanx's store at 127.0.0.1:")[1].split()[0]
    script_port = "23456" if mode == "tcp" else "12355"
    port_seen = launcher_port if mode == "tcp" else "12355"  # the script's own setting stays in its environment
    assert sorted(done.stdout.splitlines()) == [f"rank {r} sum 2 MASTER_PORT {port_seen}" for r in (0, 1)]
    said = [line for line in done.stderr.splitlines() if "PhalanxWarning" in line]
    at = next(n for n, line in enumerate(SCRIPT.read_text().splitlines(), 1) if line.endswith(f"# {mode}"))
    assert len(said) == 1 and said[0].startswith(
        f"{SCRIPT}:{at}: PhalanxWarning: the script's process group meets at localhost:{script_port} {how}, where "
        "under phalanx run and torchrun no process hosts a store"), done.stderr[-3000:]
    assert f"phalanx run joined its own store at 127.0.0.1:{launcher_port} instead" in said[0]


@pytest.mark.parametrize("mode, how", [("size", "with world_size=4"),
                                       ("environ", 'after setting os.environ["WORLD_SIZE"] = "4"')])
def test_a_world_size_other_than_the_workers_started_is_one_line_at_once(mode, how):
    done = _run(mode)
    at = next(n for n, line in enumerate(SCRIPT.read_text().splitlines(), 1) if line.endswith(f"# {mode}"))
    last = done.stderr.splitlines()[-1]
    assert done.returncode == 2 and last.startswith("phalanx: error: ") and (
        f"own_rendezvous.py:{at}: the script opens its process group {how}, and phalanx run started 2 "
        "workers (WORLD_SIZE=2)") in last, done.stderr[-3000:]
