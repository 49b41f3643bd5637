"""`phalanx bench memory` end to end through the real spawn paths (2 gloo workers per contender: phalanx's
launcher, and the fresh processes of DDP, ZeroRedundancyOptimizer and FSDP2), LeNet, one round of one
step: machinery, not speed. Checks that every contender reports the bytes it holds and its resident
set, that the stages divide what they say they divide, and that the table, JSON and PNG come out.
"""

from __future__ import annotations

import json

import pytest

from phalanx.bench.cli import run_bench
from phalanx.cli import build_parser
from phalanx.bench.memory import CONTENDERS, FSDP2_ON_CPU
from phalanx.measure.memory import HELD

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
pytestmark = pytest.mark.usefixtures("smoke_sized_cores")  # see tests/distributed/conftest.py


@pytest.mark.distributed
@pytest.mark.skipif(not FSDP2_ON_CPU, reason="this torch's FSDP2 makes CUDA streams: it cannot run on CPU workers")
def test_memory_bench_smoke(tmp_path, capsys):
    parser = build_parser(["bench"])
    argv = ["bench", "memory", "--models", "lenet", "--batch-size", "8", "--steps", "1", "--warmup-steps", "0",
            "--rounds", "1", "--out", str(tmp_path)]
    assert run_bench(parser.parse_args(argv)) == 0
    assert (tmp_path / "memory.png").read_bytes()[:8] == PNG_MAGIC
    payload = json.loads((tmp_path / "memory.json").read_text())
    rows = {r["contender"]: r for r in payload["results"]}
    assert list(rows) == list(CONTENDERS)
    for row in rows.values():
        assert row["model"] == "lenet" and row["num_parameters"] == 129_068
        assert all(len(per_rank) == 2 and min(per_rank) > 0 for per_rank in row["held_bytes_per_rank"].values())
        assert row["rss_before_model_bytes"]["median"] > 0 and row["step_s"]["median"] > 0
        assert row["peak_rss_bytes"]["median"] >= row["rss_before_model_bytes"]["median"]
        assert row["early_steps_peak_rss_bytes"]["median"] <= row["peak_rss_bytes"]["median"]
        assert [len(ranks) for ranks in row["ranks"]] == [2]
    held = {key: row["held_bytes"] for key, row in rows.items()}
    assert held["optimizer"]["optimizer_state"] <= 0.55 * held["none"]["optimizer_state"]
    assert held["gradients"]["gradients"] <= 0.55 * held["none"]["gradients"]
    assert held["parameters"]["parameters"] <= 0.55 * held["none"]["parameters"]
    whole = 4 * 129_068  # float32: every rank of an unsharded contender holds all of it
    adam_steps = 4 * 8  # Adam's step count: a float32 scalar per tensor, LeNet's 8
    flags = 4 * 8  # the usage flags after the last bucket: a float32 per tensor (data_parallel/usage.py)
    assert {part: held["none"][part] for part in HELD} == {"parameters": whole, "gradients": whole + flags,
                                                           "optimizer_state": 2 * whole + adam_steps}
    assert held["ddp"]["parameters"] == whole and held["fsdp2"]["parameters"] <= 0.55 * whole
    ratio = next(r for r in payload["ratios"]
                 if r["metric"] == "optimizer_state_bytes" and r["numerator"] == "optimizer")
    assert ratio["ratio"] == held["optimizer"]["optimizer_state"] / held["none"]["optimizer_state"]
    # phalanx's workers with its allocator setting; PyTorch's contenders as a user's script runs them.
    assert {key: v["allocator_env"] for key, v in payload["variants"].items()} == {
        key: kind == "phalanx" for key, (_, kind, _) in CONTENDERS.items()}
    out = capsys.readouterr().out
    assert "PyTorch's contenders with glibc's allocator as it comes" in out and "peak after 5 steps MB" in out
    assert "phalanx optimizer / none optimizer-state bytes:" in out and "phalanx parameters / FSDP2 peak RSS" in out
    assert all(row["name"] in out for row in rows.values())
