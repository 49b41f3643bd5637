"""`--trace` machinery without processes: the Chrome-trace schema, spans nesting per track, one
allreduce span per bucket per traced step with its bytes, the summary's arithmetic (busbw,
overlap), the bound on traced steps, and that tracing off records nothing."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch

from phalanx.models import LeNet
from phalanx.data_parallel import DataParallel, DataParallelConfig
from phalanx.telemetry import Tracer, span
from phalanx.telemetry.tracing import BUCKET_TID_BASE, MAIN_TID, _Comm, format_summary
from phalanx.data_parallel.strategy import DataSplit
from phalanx.train.loop import train_epoch
from phalanx.runtime.world import World

WORLD1 = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
               backend="none", timeout_s=10.0)


def _traced_epoch(tmp_path, *, steps_per_epoch=3, overlap=True, num_examples=80, batch=16):
    torch.manual_seed(0)
    images = torch.randint(0, 256, (num_examples, 1, 28, 28), dtype=torch.uint8)
    labels = torch.randint(0, 10, (num_examples,))
    tracer = Tracer(rank=0, world_size=1, steps_per_epoch=steps_per_epoch)
    # exchange_alone keeps the buckets and hooks in a world of one (without it there is nothing
    # to exchange and nothing to draw), so the bucket tracks are exercised here.
    options = DataParallelConfig(bucket_cap_mb=0.25, overlap=overlap, exchange_alone=True)
    with DataParallel(LeNet(), world=WORLD1, options=options, tracer=tracer) as dp:
        optimizer = torch.optim.SGD(dp.module.parameters(), lr=0.1)
        train_epoch(DataSplit(dp), optimizer, images, labels, world=WORLD1, global_batch_size=batch, seed=0, epoch=0,
                    tracer=tracer)
        with span(tracer, "evaluate"):
            pass
        # What goes on the wire: the last bucket also carries a usage flag per parameter (usage.py).
        buckets = [(b.index, b.storage.numel() * b.storage.element_size()) for b in dp.buckets]
    paths = tracer.write(tmp_path)
    return tracer, buckets, paths


def _check_nesting(events):
    by_track = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            by_track[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for track, spans in by_track.items():
        stack = []
        for start, end, name in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][1] <= start + 1e-3:
                stack.pop()
            assert not stack or end <= stack[-1][1] + 1e-3, f"{name} straddles {stack[-1][2]} on {track}"
            stack.append((start, end, name))


@pytest.mark.parametrize("overlap", [True, False])
def test_trace_schema_spans_and_one_allreduce_per_bucket_per_traced_step(tmp_path, overlap):
    tracer, buckets, paths = _traced_epoch(tmp_path, overlap=overlap)
    assert [p.name for p in paths] == ["trace-rank0.json", "summary.json"]
    trace = json.loads(paths[0].read_text())
    events = trace["traceEvents"]
    for e in events:
        assert {"name", "ph", "pid", "tid"} <= set(e), e
        if e["ph"] == "X":
            assert e["ts"] >= 0 and e["dur"] >= 0, e
    _check_nesting(events)
    names = [e["name"] for e in events if e["ph"] == "X" and e["tid"] == MAIN_TID]
    # 80 examples / 16 = 5 steps, of which the first 3 are traced; evaluation once.
    for name in ("step", "data", "forward", "backward", "wait", "optimizer"):
        assert names.count(name) == 3, (name, names.count(name))
    assert names.count("evaluate") == 1
    comm = [e for e in events if e["ph"] == "X" and e.get("cat") == "comm"]
    # Synchronous or overlapped, every bucket goes out through the one send path, and is drawn.
    assert len(comm) == 3 * len(buckets)
    for index, nbytes in buckets:
        mine = [e for e in comm if e["tid"] == BUCKET_TID_BASE + index]
        assert len(mine) == 3 and all(e["args"]["bytes"] == nbytes for e in mine)
        assert sorted(e["args"]["step"] for e in mine) == [0, 1, 2]
    tracks = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert tracks == {"compute"} | {f"bucket {i} allreduce" for i, _ in buckets}


def test_summary_fields_are_consistent(tmp_path):
    tracer, buckets, paths = _traced_epoch(tmp_path)
    summary = json.loads(paths[1].read_text())
    assert summary["traced_steps"] == 3 and summary["world_size"] == 1
    assert [(b["bucket"], b["bytes"]) for b in summary["buckets"]] == buckets
    for b in summary["buckets"]:
        assert b["count"] == 3
        assert b["time_ms"]["min"] <= b["time_ms"]["median"] <= b["time_ms"]["max"]
        assert b["busbw_gbs"] == pytest.approx(b["algbw_gbs"] * 0.0)  # 2(k-1)/k = 0 for k = 1
    assert 0.0 <= summary["overlap_percent"] <= 100.0
    assert summary["wait_ms"]["median"] >= 0 and summary["step_ms"]["median"] > 0


def test_busbw_and_overlap_arithmetic_on_a_hand_made_timeline():
    tracer = Tracer(rank=0, world_size=4)
    # Step 0: backward runs 0-10 s; bucket 0 (1 GB) communicates 6-8 (fully hidden), bucket 1
    # (2 GB) 9-13 (1 s of 4 hidden). Overlap = (2 + 1) / (2 + 4) = 50%.
    tracer._backward[0] = [(0.0, 10.0)]
    tracer._comms += [_Comm(step=0, bucket=0, nbytes=10**9, kind="allreduce", launch_s=6.0, done_s=8.0),
                      _Comm(step=0, bucket=1, nbytes=2 * 10**9, kind="allreduce", launch_s=9.0, done_s=13.0)]
    summary = tracer.summary()
    assert summary["overlap_percent"] == pytest.approx(50.0)
    b0, b1 = summary["buckets"]
    assert b0["algbw_gbs"] == pytest.approx(0.5) and b1["algbw_gbs"] == pytest.approx(0.5)
    assert b0["busbw_gbs"] == pytest.approx(0.5 * 2 * 3 / 4)  # nccl-tests: algbw * 2(k-1)/k
    assert summary["collective_ms_per_step"] == pytest.approx(6000.0)


def test_a_sharded_buckets_reduce_scatter_is_named_and_its_busbw_is_half_an_allreduces():
    tracer = Tracer(rank=0, world_size=4)
    tracer._backward[0] = [(0.0, 10.0)]
    tracer._comms.append(_Comm(step=0, bucket=0, nbytes=10**9, kind="reduce-scatter", launch_s=6.0, done_s=8.0))
    (bucket,) = tracer.summary()["buckets"]
    assert bucket["kind"] == "reduce-scatter"
    assert bucket["busbw_gbs"] == pytest.approx(0.5 * 3 / 4)  # nccl-tests: algbw * (k-1)/k
    text = format_summary(tracer.summary())
    assert "reduce-scatter 2000.00 ms" in text and "of reduce-scatter time hidden" in text
    assert "reduce-scatter bucket 0" in {e["name"] for e in tracer.chrome_trace()["traceEvents"]}
    with pytest.raises(ValueError, match="kind must be one of allreduce, reduce-scatter"):
        tracer.comm_launched(0, 8, "broadcast")


def test_only_the_first_steps_of_each_epoch_are_recorded():
    tracer = Tracer(rank=0, world_size=2, steps_per_epoch=2)
    for epoch in range(3):
        for step in range(5):
            tracer.begin_step(step)
            with tracer.span("step"):
                pass
            tracer.end_step()
    assert len(tracer._steps_s) == 3 * 2  # bounded: 2 per epoch, not 5
    with pytest.raises(ValueError, match="steps_per_epoch"):
        Tracer(rank=0, world_size=1, steps_per_epoch=0)


def test_tracing_off_is_one_shared_no_op():
    assert span(None, "forward") is span(None, "backward")  # nothing allocated per span
    tracer = Tracer(rank=0, world_size=1)
    with tracer.span("forward"):  # outside a step: not recorded
        pass
    assert tracer.chrome_trace()["traceEvents"][2:] == []
