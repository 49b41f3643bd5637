"""`phalanx train --trace DIR` on 2 real gloo processes: a trace file per rank, bucket allreduces
on their own tracks, rank 0's summary with nccl-tests' bandwidths; nothing written without it."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed


def _train(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "phalanx", "train", "--devices", "cpu:2", "--dataset", "synthetic",
                           "--epochs", "1", "--no-progress", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("mode", [["--allreduce", "ring"], ["--no-overlap"]])
def test_trace_per_rank_and_summary(tmp_path, mode):
    trace_dir = tmp_path / "trace"
    proc = _train("--trace", str(trace_dir), "--trace-steps", "4", *mode)
    assert proc.returncode == 0, proc.stderr
    assert "overlap:" in proc.stdout and "busbw" in proc.stdout
    assert sorted(p.name for p in trace_dir.iterdir()) == ["summary.json", "trace-rank0.json", "trace-rank1.json"]
    summary = json.loads((trace_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["traced_steps"] == 4
    num_buckets = 1 if "--no-overlap" in mode else 3  # LeNet at the default 0.25 MB cap
    assert len(summary["buckets"]) == num_buckets
    # every float32 gradient once, and the usage flags: one per parameter tensor (8), in the last bucket
    assert sum(b["bytes"] for b in summary["buckets"]) == (129_068 + 8) * 4
    for b in summary["buckets"]:
        assert b["count"] == 4 and b["time_ms"]["median"] > 0
        assert b["busbw_gbs"] == pytest.approx(b["algbw_gbs"])  # 2(k-1)/k = 1 at k = 2
    assert 0.0 <= summary["overlap_percent"] <= 100.0
    for rank in (0, 1):
        events = json.loads((trace_dir / f"trace-rank{rank}.json").read_text())["traceEvents"]
        assert {e["pid"] for e in events} == {rank}
        comm = [e for e in events if e.get("cat") == "comm"]
        assert len(comm) == 4 * num_buckets
        backward = [e for e in events if e.get("name") == "backward"]
        assert len(backward) == 4
        assert any(e["name"] == "evaluate" for e in events)


def test_no_trace_flag_writes_no_trace(tmp_path):
    out = tmp_path / "run"
    proc = _train("--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "overlap:" not in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["accuracy.png", "metrics.jsonl", "model.pt"]
