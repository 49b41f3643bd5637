"""A torchrun job whose node refuses its command line, or whose worker never joins, ends every
node in one line (phalanx/runtime/join.py): the refusing node's line, relayed through the job's
store within a poll, or, after --timeout, the ranks that never checked in - not a wait of the
whole --timeout and a DistStoreError traceback on the nodes that were fine.

Two torchrun agents on this host (`--nnodes 2`, static rendezvous at 127.0.0.1), as
test_two_nodes.py starts them, each with its own command line.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.distributed.test_two_nodes import _env, _free_port, stop_and_read

pytestmark = pytest.mark.distributed

TRAIN = ["-m", "phalanx", "train", "--dataset", "digits", "--epochs", "1", "--batch-size", "64", "--no-progress",
         "--threads-per-device", "1"]


def _nodes(argvs: list[list[str]], deadline_s: float, wait_for: tuple[int, ...] | None = None
           ) -> tuple[list[int | None], list[str], list[float]]:
    """Start node n with torchrun's flags and argvs[n]; (exit codes, stderr texts, seconds until each
    ended). Whatever runs past `deadline_s`, or is still running once the nodes `wait_for` (default:
    all) have ended, is killed with everything it started."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun, "torchrun ships with torch"
    port, started = _free_port(), time.monotonic()
    with tempfile.TemporaryDirectory() as logs:
        errs = [open(Path(logs) / f"node{node}.err", "w+") for node in range(len(argvs))]
        agents = [subprocess.Popen([torchrun, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                                    "--master-addr", "127.0.0.1", "--master-port", str(port), *argv],
                                   stdout=subprocess.DEVNULL, stderr=errs[node], text=True, env=_env(),
                                   start_new_session=True)
                  for node, argv in enumerate(argvs)]
        ended = [float("inf")] * len(agents)
        try:
            awaited = range(len(agents)) if wait_for is None else wait_for
            while time.monotonic() - started < deadline_s and any(ended[node] == float("inf") for node in awaited):
                for node, agent in enumerate(agents):
                    if agent.poll() is not None and ended[node] == float("inf"):
                        ended[node] = time.monotonic() - started
                time.sleep(0.1)
        finally:
            texts = stop_and_read(agents, errs)
    return [agent.returncode for agent in agents], texts, ended


def test_a_node_that_refuses_its_out_ends_the_other_node_at_once_with_its_line(tmp_path):
    codes, errs, elapsed = _nodes([[*TRAIN, "--timeout", "90", "--out", str(tmp_path / "run")],
                                   [*TRAIN, "--timeout", "90", "--out", "/proc/phalanx-run"]], deadline_s=150)
    refused = ("--out /proc/phalanx-run cannot be created (No such file or directory in /proc); pick a directory on "
               "a writable filesystem")
    assert f"phalanx: error: {refused}" in errs[1].splitlines(), errs[1][-2000:]
    relayed = f"phalanx: error: rank 1 (node 1) refused its command line: {refused}; fix it there and start every " \
              "node again"
    assert relayed in errs[0].splitlines(), errs[0][-2000:]
    assert "DistStoreError" not in errs[0] and codes == [1, 1]
    assert max(elapsed) < 60, elapsed  # before: node 0 waited the whole --timeout (90 s)


def test_a_worker_that_never_joins_is_named_when_the_timeout_runs_out(tmp_path):
    idle = tmp_path / "idle.py"
    idle.write_text("import time\ntime.sleep(120)\n")  # a node whose worker never reaches the join
    codes, errs, elapsed = _nodes([[*TRAIN, "--timeout", "10"], [str(idle)]], deadline_s=60, wait_for=(0,))
    line = ("phalanx: run stopped: rank 0 (node 0) waited 10 s (--timeout) for rank 1 to join the job: its worker "
            "stopped before joining (that node's own output says why) or cannot reach this job's store; torchrun's "
            "agent ends this node's workers")
    assert line in errs[0].splitlines(), errs[0][-2000:]
    assert "Traceback" not in errs[0].split("torch/distributed/elastic")[0], errs[0][-2000:]
    assert codes[0] == 1 and elapsed[0] < 45, (codes, elapsed)
