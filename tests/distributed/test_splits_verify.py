"""`phalanx verify --split layers|channels` compares every step with 1 device and passes in float64.

Through the CLI on a synthetic set: per step, gradients and parameters of the assembled model
against the 1-device run to verify's float64 tolerance (1e-9 relative). A pipeline whose stages
skipped a micro-batch's backward, or channels without the reduce-scatter, would fail at step 1.
"""

import json

import pytest

from phalanx.cli import main

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("argv", [["--split", "layers", "--devices", "2,4", "--schedule", "1f1b", "--micro-batches", "3"],
                                  ["--split", "channels", "--devices", "3"]])
def test_verify_split_passes_step_by_step(argv, tmp_path, capsys):
    out = tmp_path / "verify.json"
    code = main(["verify", "--steps", "3", "--out", str(out), *argv])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "verdict: PASS" in printed
    k = argv[argv.index("--devices") + 1].split(",")[-1]  # no batch split: each device sees the whole batch
    assert f"k = {k} vs 1 device (first batch 61 = whole on each of the {k} devices): PASS" in printed, printed
    report = json.loads(out.read_text())
    assert report["passed"] and all(r["passed"] for r in report["results"])


def test_verify_split_refuses_a_plant_and_a_bad_k(capsys):
    assert main(["verify", "--split", "layers", "--devices", "5"]) == 2
    assert "needs 1 to 4 devices, not 5" in capsys.readouterr().err
    assert main(["verify", "--split", "channels", "--plant", "rank-mean"]) == 2
    assert "--plant plants data-parallel bugs" in capsys.readouterr().err
