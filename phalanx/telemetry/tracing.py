"""Where a step's time goes, per rank: Chrome-trace spans and the run's communication summary.

`phalanx train --trace DIR` gives every rank a `Tracer`. The loop wraps data, forward, backward,
the wait in finish_gradient_sync, the optimizer step and evaluation in spans; DataParallel reports
each bucket's collective (its allreduce; its reduce-scatter when sharded) when it is launched and
when the backend says it is *done* (a completion callback on the comm thread, not the later wait),
so a bucket that finished while backward was still running shows as such. Each rank writes
`trace-rank<r>.json` in the Trace Event Format (open it in https://ui.perfetto.dev or
chrome://tracing): compute on one track, each bucket's collective on a track of its own. Rank 0
also writes `summary.json`: bytes per bucket, time per collective, algbw and busbw as nccl-tests
defines them (algbw = bytes / time, bytes being the whole bucket; busbw = algbw x bandwidth.py's
factor: 2(k-1)/k for an allreduce, (k-1)/k for a reduce-scatter, which moves half of its bytes), the wait per
step, and the overlap percentage - the share of the collectives' time that ran while backward was
still computing.

Memory stays bounded: only the first `steps_per_epoch` steps of every epoch are recorded.
Tracing off is `tracer=None`: the loop then enters a shared no-op context per span and takes no
timestamps, allocates nothing, registers no callbacks.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from phalanx.atomic import atomic_write_bytes
from phalanx.telemetry.bandwidth import busbw_factor

MAIN_TID = 1
BUCKET_TID_BASE = 100  # bucket i's collective is drawn on track 100 + i
BUCKET_KINDS = ("allreduce", "reduce-scatter")  # the collectives a bucket's gradients are sent with
_NULL = contextlib.nullcontext()


def span(tracer: "Tracer | None", name: str):
    """`with span(tracer, "forward"):` - a recorded span, or the shared no-op when tracing is off."""
    return _NULL if tracer is None else tracer.span(name)


@dataclass
class _Comm:
    step: int
    bucket: int
    nbytes: int
    kind: str  # one of BUCKET_KINDS
    launch_s: float
    done_s: float | None = None


class Tracer:
    """Collects one rank's spans; `write(dir)` saves them (and rank 0's summary) atomically."""

    def __init__(self, *, rank: int, world_size: int, steps_per_epoch: int = 20) -> None:
        if steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be at least 1, got {steps_per_epoch}")
        self.rank, self.world_size, self.steps_per_epoch = rank, world_size, steps_per_epoch
        self._t0 = time.perf_counter()
        self._events: list[dict[str, Any]] = []
        self._comms: list[_Comm] = []
        self._backward: dict[int, list[tuple[float, float]]] = {}  # step -> backward windows
        self._waits_s: list[float] = []
        self._steps_s: list[float] = []
        self._lock = threading.Lock()  # completion callbacks run on the backend's threads
        self._step = -1  # global id of the step being recorded, -1 outside recorded steps
        self._next_step = 0
        self._bucket_names: set[int] = set()

    # --- recording -------------------------------------------------------------------------
    @property
    def recording(self) -> bool:
        return self._step >= 0

    def begin_step(self, step_in_epoch: int) -> None:
        """Start a training step; it is recorded when among the first steps_per_epoch."""
        self._step = self._next_step if step_in_epoch < self.steps_per_epoch else -1
        self._next_step += 1

    def end_step(self) -> None:
        self._step = -1

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        if not self.recording and name != "evaluate":  # evaluation is traced every epoch
            yield
            return
        start_s = time.perf_counter()
        try:
            yield
        finally:
            end_s = time.perf_counter()
            self._add(name, "compute", MAIN_TID, start_s, end_s)
            if name == "backward" and self.recording:
                self._backward.setdefault(self._step, []).append((start_s, end_s))
            elif name == "wait":
                self._waits_s.append(end_s - start_s)
            elif name == "step":
                self._steps_s.append(end_s - start_s)

    def comm_launched(self, bucket: int, nbytes: int, kind: str = "allreduce") -> _Comm | None:
        """A bucket's collective (`kind`, one of BUCKET_KINDS) starts now; pass the result to
        `comm_done` on completion."""
        if kind not in BUCKET_KINDS:
            raise ValueError(f"comm_launched: kind must be one of {', '.join(BUCKET_KINDS)}, got {kind!r}")
        if not self.recording:
            return None
        record = _Comm(step=self._step, bucket=bucket, nbytes=nbytes, kind=kind, launch_s=time.perf_counter())
        with self._lock:
            self._comms.append(record)
        return record

    @staticmethod
    def comm_done(record: _Comm | None) -> None:
        if record is not None and record.done_s is None:
            record.done_s = time.perf_counter()

    def _add(self, name: str, cat: str, tid: int, start_s: float, end_s: float, **args: Any) -> None:
        event = {"name": name, "cat": cat, "ph": "X", "pid": self.rank, "tid": tid,
                 "ts": (start_s - self._t0) * 1e6, "dur": max(0.0, end_s - start_s) * 1e6}
        if args:
            event["args"] = args
        with self._lock:
            self._events.append(event)

    # --- output ----------------------------------------------------------------------------
    def chrome_trace(self) -> dict[str, Any]:
        """The Trace Event Format object: metadata, compute spans, one track per bucket."""
        events = [{"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": f"rank {self.rank}"}},
                  {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": MAIN_TID, "args": {"name": "compute"}}]
        with self._lock:
            events += list(self._events)
            comms = [c for c in self._comms if c.done_s is not None]
        for bucket in sorted({c.bucket for c in comms}):
            events.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": BUCKET_TID_BASE + bucket,
                           "args": {"name": f"bucket {bucket} " + next(c.kind for c in comms if c.bucket == bucket)}})
        for c in comms:
            events.append({"name": f"{c.kind} bucket {c.bucket}", "cat": "comm", "ph": "X", "pid": self.rank,
                           "tid": BUCKET_TID_BASE + c.bucket, "ts": (c.launch_s - self._t0) * 1e6,
                           "dur": (c.done_s - c.launch_s) * 1e6, "args": {"bytes": c.nbytes, "step": c.step}})
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"rank": self.rank, "world_size": self.world_size,
                              "steps_per_epoch_traced": self.steps_per_epoch}}

    def summary(self) -> dict[str, Any]:
        """Per-bucket bytes/time/bandwidth, wait and step time, and the overlap percentage."""
        with self._lock:
            comms = [c for c in self._comms if c.done_s is not None]
        buckets = []
        for index in sorted({c.bucket for c in comms}):
            times = [c.done_s - c.launch_s for c in comms if c.bucket == index]
            nbytes, kind = next((c.nbytes, c.kind) for c in comms if c.bucket == index)
            median_s = statistics.median(times)
            algbw = nbytes / median_s / 1e9 if median_s > 0 else 0.0
            buckets.append({"bucket": index, "kind": kind, "bytes": nbytes, "count": len(times),
                            "time_ms": {"median": median_s * 1e3, "min": min(times) * 1e3, "max": max(times) * 1e3},
                            "algbw_gbs": algbw, "busbw_gbs": algbw * busbw_factor(self.world_size, kind)})
        comm_s = sum(c.done_s - c.launch_s for c in comms)
        hidden_s = sum(_overlap(c.launch_s, c.done_s, self._backward.get(c.step, [])) for c in comms)
        return {"rank": self.rank, "world_size": self.world_size, "traced_steps": len(self._steps_s),
                "buckets": buckets, "collective_ms_per_step": _per_step_ms(comms),
                "wait_ms": _spread_ms(self._waits_s), "step_ms": _spread_ms(self._steps_s),
                "overlap_percent": 100.0 * hidden_s / comm_s if comm_s > 0 else 0.0}

    def write(self, out_dir: str | Path) -> list[Path]:
        """Write trace-rank<r>.json (every rank) and summary.json (rank 0); return the paths."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = [out / f"trace-rank{self.rank}.json"]
        atomic_write_bytes(paths[0], json.dumps(self.chrome_trace()).encode())
        if self.rank == 0:
            paths.append(out / "summary.json")
            atomic_write_bytes(paths[1], json.dumps(self.summary(), indent=2).encode())
        return paths


def _overlap(start_s: float, end_s: float, windows: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(end_s, hi) - max(start_s, lo)) for lo, hi in windows)


def _spread_ms(values_s: list[float]) -> dict[str, float] | None:
    if not values_s:
        return None
    return {"median": statistics.median(values_s) * 1e3, "min": min(values_s) * 1e3, "max": max(values_s) * 1e3}


def _per_step_ms(comms: list[_Comm]) -> float:
    steps = {c.step for c in comms}
    return sum(c.done_s - c.launch_s for c in comms) / len(steps) * 1e3 if steps else 0.0


def format_summary(summary: dict[str, Any]) -> str:
    """A few lines for the terminal: one per bucket, then wait, step and overlap."""
    lines = [f"trace summary (rank 0, {summary['traced_steps']} traced steps, {summary['world_size']} ranks):"]
    for b in summary["buckets"]:
        t = b["time_ms"]
        lines.append(f"  bucket {b['bucket']}: {b['bytes'] / 1024:.1f} KB, {b['kind']} {t['median']:.2f} ms "
                     f"({t['min']:.2f}-{t['max']:.2f}), algbw {b['algbw_gbs']:.3f} GB/s, busbw {b['busbw_gbs']:.3f} GB/s")
    wait, step = summary["wait_ms"], summary["step_ms"]
    if wait and step:
        lines.append(f"  step {step['median']:.1f} ms, wait after backward {wait['median']:.2f} ms (medians)")
    kinds = " and ".join(sorted({b["kind"] for b in summary["buckets"]})) or "collective"
    lines.append(f"  overlap: {summary['overlap_percent']:.0f}% of {kinds} time hidden behind backward")
    return "\n".join(lines)
