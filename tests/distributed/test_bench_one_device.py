"""`phalanx bench step` end to end on the CPU, small: both contenders run in fresh processes and the
table, JSON and PNG name the host time per step and the ratio. (Its figures are the command's
business; this checks the machinery.)"""

from __future__ import annotations

import json

import pytest

from phalanx.cli import main

pytestmark = pytest.mark.usefixtures("smoke_sized_cores")


def test_bench_step_smoke(tmp_path, capsys):
    out = tmp_path / "step"
    assert main(["bench", "step", "--rounds", "1", "--steps", "6", "--epochs", "1", "--warmup-epochs", "0",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "phalanx's step / the plain loop's: host" in text and "us more host time than the plain loop's" in text
    payload = json.loads((out / "step.json").read_text())
    assert [r["contender"] for r in payload["results"]] == ["phalanx", "plain"]
    assert all(r["host_us_per_step"]["median"] > 0 for r in payload["results"])
    assert (out / "step.png").stat().st_size > 0
