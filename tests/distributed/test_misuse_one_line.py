"""A call the replica refuses in a script's own code is one line under `phalanx run`, led by the
script's line, exit 2, as bad input is (errors.Misuse); so is torch's DDP wrapped around a
replica. Before 2026-12-06 each was a RuntimeError: every rank's traceback, "rank 1 failed too",
exit 1. Still a RuntimeError to code that catches it (tests/unit: the replicas' refusals are
caught as RuntimeError there)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = textwrap.dedent("""\
    import sys
    import torch, torch.nn.functional as F
    import phalanx

    world = phalanx.init()
    torch.manual_seed(0)
    misuse = sys.argv[1]
    if misuse == "whole-optimizer":
        dp = phalanx.prepare(torch.nn.Linear(10, 2), world=world, shard="parameters")
        optimizer = torch.optim.SGD(dp.parameters(), lr=0.1)
    else:
        dp = phalanx.prepare(torch.nn.Linear(10, 2), world=world, overlap=False)
        optimizer = dp.optimizer(torch.optim.SGD, lr=0.1)
    if misuse == "ddp-around":  # a ported script's DDP line kept after prepare
        dp = torch.nn.parallel.DistributedDataParallel(dp)
    x, y = torch.randn(8, 10), torch.randint(0, 2, (8,))
    phalanx.shard_loss(F.cross_entropy(dp(x), y, reduction="sum"), 16).backward()
    if misuse == "whole-optimizer":
        dp.finish_gradient_sync()
    if misuse == "closed":  # a loop that goes on after dp.close()
        dp.finish_gradient_sync()
        dp.close()
        dp.finish_gradient_sync()  # after close
    optimizer.step()
""")

STEP_LINE = SCRIPT.splitlines().index("optimizer.step()") + 1
DDP_LINE = SCRIPT.splitlines().index("    dp = torch.nn.parallel.DistributedDataParallel(dp)") + 1
CLOSED_LINE = SCRIPT.splitlines().index("    dp.finish_gradient_sync()  # after close") + 1


@pytest.mark.parametrize("misuse, line, words", [
    ("whole-optimizer", STEP_LINE, "this optimizer steps the replica's whole parameters, but shard='parameters' "
                                   "sums each rank's gradient range only; build it with dp.optimizer(SGD, ...)"),
    ("forgotten-sync", STEP_LINE, "optimizer.step() after a backward whose gradients were never summed across ranks: "
                                  "call dp.finish_gradient_sync() between loss.backward() and optimizer.step()"),
    # Before 2026-12-06 refused only at the step, blaming a clip (DDP had written the gradients in place).
    ("ddp-around", DDP_LINE, "DistributedDataParallel around the replica phalanx.prepare returned would exchange "
                             "its gradients a second time: drop the DDP(...) wrap"),
    # Until 2026-12-06 a RuntimeError's traceback on every rank, "DataParallel is closed", without a fix.
    ("closed", CLOSED_LINE, "dp.finish_gradient_sync() after dp.close(): a closed replica exchanges nothing; "
                            "close it after the last step"),
])
def test_a_refused_call_is_one_line_naming_the_scripts_line(tmp_path, misuse, line, words):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run = subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", "--timeout", "30", str(script),
                          misuse], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 2, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"phalanx: error: train.py:{line}: {words}"), run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "failed too" not in run.stderr, run.stderr[-3000:]
