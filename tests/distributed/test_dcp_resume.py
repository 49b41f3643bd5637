"""torch.distributed.checkpoint on phalanx's replica across 2 workers: a run that saves with
`dcp.save(get_state_dict(dp, optimizer))` after 3 steps and resumes in a new run with
`dcp.load` + `set_state_dict` ends bitwise equal to 6 steps straight, its optimizer state named
by the model's own parameter names. Before 2026-12-05 `get_state_dict(dp, ...)` stopped inside
torch, and once it ran the resumed run restarted Adam from zero moments silently
(tests/unit/test_dcp_state_dict.py says why)."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed
dcp_state_dict = pytest.importorskip("torch.distributed.checkpoint.state_dict")

SCRIPT = Path(__file__).resolve().parent / "scripts" / "dcp_resume.py"


def _run(*args: str) -> None:
    ran = subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", "--quiet", str(SCRIPT), *args],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert ran.returncode == 0, ran.stderr[-3000:]


@pytest.mark.skipif("dsd_fqn_modifiers" not in inspect.signature(dcp_state_dict._get_fqns).parameters,
                    reason="torch before 2.7 does not ask the replica its names: set_state_dict's KeyError in torch")
def test_a_run_resumed_through_dcp_ends_bitwise_as_one_run_straight(tmp_path):
    _run("--steps", "0", "6", "--out", str(tmp_path / "straight.pt"))
    _run("--steps", "0", "3", "--save", str(tmp_path / "dcp"), "--out", str(tmp_path / "first.pt"))
    _run("--steps", "3", "6", "--load", str(tmp_path / "dcp"), "--out", str(tmp_path / "resumed.pt"))
    straight = torch.load(tmp_path / "straight.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert resumed["optimizer keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    for name, value in straight["model"].items():
        assert torch.equal(resumed["model"][name], value), name
