"""`phalanx sweep` end to end on scikit-learn's digits: 4 points of 1 epoch (k = 1 in process,
k = 2 spawned gloo workers), then the same sweep with --resume, which must train nothing.

Runs in a child interpreter under a hard timeout, so a hung collective fails the test instead of
stalling the suite. Checks the table, the three files, the per-point files, that the two points
with the same global batch and lr but different k reach the same accuracy (k devices compute
the 1-device step), and that warmup goes only to the points the scaling rule raises.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.distributed

DRIVER = textwrap.dedent("""
    import sys
    from phalanx.cli import build_parser
    from phalanx.sweep.cli import run_sweep

    if __name__ == "__main__":  # spawned workers import this file too
        sys.exit(run_sweep(build_parser(["sweep"]).parse_args(["sweep", *sys.argv[1:]])))
""")
ARGS = ["--dataset", "digits", "--devices", "1,2", "--per-device-batch", "32,64", "--lr", "scaled",
        "--base-lr", "0.2", "--base-batch", "64", "--warmup-epochs", "0.5", "--epochs", "1", "--timeout", "30"]


def _sweep(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    proc = subprocess.run([sys.executable, str(driver), *ARGS, "--out", str(tmp_path / "out"), *extra],
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_tiny_sweep_end_to_end_then_resume(tmp_path):
    proc = _sweep(tmp_path, "--target", "0.3")
    out = tmp_path / "out"
    table = [line for line in proc.stdout.splitlines() if line[:1].isdigit()]
    assert [line.split()[:4] for line in table] == [["1", "32", "32", "scaled"], ["1", "64", "64", "scaled"],
                                                     ["2", "32", "64", "scaled"], ["2", "64", "128", "scaled"]]
    assert proc.stderr.count("final test acc") == 4 and "2 point(s) on 2 CPU worker(s)" in proc.stderr

    payload = json.loads((out / "sweep.json").read_text())
    rows = {r["key"]: r for r in payload["results"]}
    assert list(rows) == ["k1-b32-lrscaled", "k1-b64-lrscaled", "k2-b32-lrscaled", "k2-b64-lrscaled"]
    assert payload["dataset"] == "digits" and payload["config"]["epochs"] == 1 and payload["wall_s"] > 0
    assert [(r["lr"], r["warmup_epochs"]) for r in rows.values()] == [(0.1, 0), (0.2, 0), (0.2, 0), (0.4, 0.5)]
    for r in rows.values():
        assert len(r["history"]) == 1 and r["final_test_acc"] == r["history"][0]["test_acc"]
        assert r["sec_per_epoch"] == pytest.approx(r["history"][0]["epoch_s"]) and r["sec_per_epoch"] > 0
        reached = r["history"][0]["test_acc"] >= 0.3
        assert (r["time_to_target_s"] is not None) == reached and (r["epochs_to_target"] == 1) == reached
    # Same global batch (64) and lr on 1 and on 2 devices: the same training, up to float32 rounding.
    assert rows["k1-b64-lrscaled"]["final_test_acc"] == pytest.approx(rows["k2-b32-lrscaled"]["final_test_acc"],
                                                                      abs=0.01)
    assert len(list(csv.DictReader((out / "sweep.csv").open()))) == 4
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (out / "points").iterdir()) == [f"{key}.json" for key in rows]
    assert not [p for p in out.rglob(".*")]  # no temporary files left behind

    again = _sweep(tmp_path, "--target", "0.01", "--resume")  # nothing to train; times re-read at the new target
    assert again.stderr.count("reusing the stored result") == 4 and "CPU worker" not in again.stderr
    assert "4 of 4 points reused" in again.stdout and "reused" not in proc.stdout
    resumed = {r["key"]: r for r in json.loads((out / "sweep.json").read_text())["results"]}
    for key, r in resumed.items():
        assert r["history"] == rows[key]["history"] and r["reused"] and not rows[key]["reused"]
        assert r["epochs_to_target"] == 1 and r["time_to_target_s"] == pytest.approx(r["history"][0]["epoch_s"])
