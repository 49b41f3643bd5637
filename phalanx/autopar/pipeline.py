"""Experiment 3 on CPU: computation, communication and a receiver's reduction, all at the same time.

D2L's exercise 3 asks for computation on CPUs and GPUs with communication between them, all at
once. Without a GPU this is the labelled CPU analogue: two worker processes (one thread each,
through `phalanx.runtime.launch`). Rank 0 computes chunk i (`tanh(x_i @ w)`) while gloo carries chunk
i-1 to rank 1 (isend/irecv, double-buffered on both ends) while rank 1 reduces chunk i-2 to its
Gram matrix and adds it to an accumulator. "In sequence" runs the same stages one at a time
(rank 0 waits for rank 1's acknowledgement before the next chunk). Each stage's duration comes
from the sequential run (compute and reduce on their own rank, transfer from the send's start on
rank 0 to the receive's end on rank 1: CLOCK_MONOTONIC is one clock for all processes of a
host), so the ideal is the pipeline's bound, sum(stages) + (chunks - 1) x slowest stage. The
check: rank 1's accumulator is bitwise the same in both runs and equal to rank 0's own
single-process reference (same ops, same thread count). The GPU variant is in autopar_cuda.py.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from phalanx.autopar.trace import label, merge_traces, profiled
from phalanx.measure.timing import run_interleaved
from phalanx.runtime.devices import parse_devices
from phalanx.runtime.launch import LaunchSpec, launch
from phalanx.runtime.world import World



@dataclass(frozen=True, kw_only=True)
class PipelineJob:
    chunks: int
    chunk_rows: int
    width: int  # chunk i is chunk_rows x width; compute is a width x width product per row
    rounds: int
    dtype: str = "float32"
    trace_dir: str | None = None
    seed: int = 0


def _inputs(job: PipelineJob) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(job.seed)
    dtype = getattr(torch, job.dtype)
    xs = [torch.randn(job.chunk_rows, job.width, generator=g, dtype=dtype) for _ in range(job.chunks)]
    w = torch.randn(job.width, job.width, generator=g, dtype=dtype) / job.width ** 0.5
    return xs, w


def _compute(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    torch.mm(x, w, out=out)


def _reduce(chunk: torch.Tensor, acc: torch.Tensor) -> None:
    acc.addmm_(chunk.T, chunk)  # the chunk's Gram matrix, summed over chunks


def reference_accumulator(job: PipelineJob) -> torch.Tensor:
    """Every stage in one process, chunk by chunk: what rank 1 must end up with, bit for bit."""
    xs, w = _inputs(job)
    out = torch.empty(job.chunk_rows, job.width, dtype=getattr(torch, job.dtype))
    acc = torch.zeros(job.width, job.width, dtype=out.dtype)
    for x in xs:
        _compute(x, w, out)
        _reduce(out, acc)
    return acc


class _Ends:
    """One rank's buffers and its two ways of running the pipeline."""

    def __init__(self, world: World, job: PipelineJob) -> None:
        self.world, self.job = world, job
        self.xs, self.w = _inputs(job) if world.rank == 0 else ([], None)
        dtype = getattr(torch, job.dtype)
        self.slots = [torch.empty(job.chunk_rows, job.width, dtype=dtype) for _ in range(2)]
        self.acc = torch.zeros(job.width, job.width, dtype=dtype)
        self.ack = torch.zeros(1)
        self.stamps: dict[str, list[float]] = {}

    def sequential(self) -> float:
        """One stage at a time; stamps every stage of every chunk (CLOCK_MONOTONIC)."""
        dist.barrier()
        self.acc.zero_()
        stamps: dict[str, list[float]] = {"compute": [], "send_start": [], "recv_end": [], "reduce": []}
        start_s = time.monotonic()
        for i in range(self.job.chunks):
            if self.world.rank == 0:
                t = time.monotonic()
                with label(f"compute {i} @rank0"):
                    _compute(self.xs[i], self.w, self.slots[0])
                stamps["compute"].append(time.monotonic() - t)
                stamps["send_start"].append(time.monotonic())
                with label(f"send {i} @rank0"):
                    dist.send(self.slots[0], dst=1)
                dist.recv(self.ack, src=1)  # rank 1 has reduced chunk i: only now the next one
            else:
                with label(f"recv {i} @rank1"):
                    dist.recv(self.slots[0], src=0)
                stamps["recv_end"].append(time.monotonic())
                t = time.monotonic()
                with label(f"reduce {i} @rank1"):
                    _reduce(self.slots[0], self.acc)
                stamps["reduce"].append(time.monotonic() - t)
                dist.send(self.ack, dst=0)
        dist.barrier()
        self.stamps = stamps
        return time.monotonic() - start_s

    def pipelined(self) -> float:
        """Compute i, transfer i-1 and reduce i-2 at once: two slots on each end, async p2p."""
        dist.barrier()
        self.acc.zero_()
        start_s = time.monotonic()
        chunks = self.job.chunks
        if self.world.rank == 0:
            sends: list[Any] = [None, None]
            for i in range(chunks):
                slot = i % 2
                if sends[slot] is not None:
                    sends[slot].wait()  # chunk i-2 has left this slot
                with label(f"compute {i} @rank0"):
                    _compute(self.xs[i], self.w, self.slots[slot])
                sends[slot] = dist.isend(self.slots[slot], dst=1)
            for handle in sends:
                if handle is not None:
                    handle.wait()
        else:
            recvs = [dist.irecv(self.slots[0], src=0), None]
            for i in range(chunks):
                slot = i % 2
                with label(f"recv-wait {i} @rank1"):
                    recvs[slot].wait()
                if i + 1 < chunks:  # the other slot's chunk (i-1) is reduced: receive into it
                    recvs[1 - slot] = dist.irecv(self.slots[1 - slot], src=0)
                with label(f"reduce {i} @rank1"):
                    _reduce(self.slots[slot], self.acc)
        dist.barrier()
        return time.monotonic() - start_s


def _worker(world: World, job: PipelineJob) -> dict[str, Any]:
    ends = _Ends(world, job)
    stage_rounds: list[dict[str, list[float]]] = []

    def sequential() -> float:
        elapsed_s = ends.sequential()
        stage_rounds.append(ends.stamps)
        return elapsed_s

    samples = run_interleaved({"in sequence": sequential, "pipelined": ends.pipelined},
                              rounds=job.rounds, warmup_rounds=1)
    stage_rounds = stage_rounds[1:]  # the warm-up round's stamps are discarded with its time
    results = {"samples": samples, "stages": stage_rounds}
    ends.pipelined()
    results["acc_pipelined"] = ends.acc.clone()
    ends.sequential()
    results["acc_sequential"] = ends.acc.clone()
    if world.rank == 0:
        results["acc_reference"] = reference_accumulator(job)
    if job.trace_dir is not None:
        with profiled(job.trace_dir, f"exp3-rank{world.rank}"):
            ends.sequential()
            ends.pipelined()
    return results


def stage_seconds(rank0: dict[str, list[float]], rank1: dict[str, list[float]]) -> dict[str, float]:
    """Median per-chunk duration of each stage in one sequential round (both ranks' stamps)."""
    transfer = [end - start for start, end in zip(rank0["send_start"], rank1["recv_end"])]
    return {"compute": statistics.median(rank0["compute"]), "transfer": statistics.median(transfer),
            "reduce": statistics.median(rank1["reduce"])}


def pipeline_bound_s(stages_s: dict[str, float], chunks: int) -> float:
    """A pipeline over `chunks` cannot beat fill + drain + one slowest stage per further chunk."""
    return sum(stages_s.values()) + (chunks - 1) * max(stages_s.values())


def run_cpu_pipeline(job: PipelineJob, *, timeout_s: float, deadline_s: float) -> dict[str, Any]:
    """Both processes' measurements combined: per round measured, in-sequence and ideal seconds."""
    spec = LaunchSpec(plan=parse_devices("cpu:2", cuda_count=0), threads_per_device=1,
                      timeout_s=timeout_s, deadline_s=deadline_s)
    rank0, rank1 = launch(_worker, job, spec=spec)
    if job.trace_dir is not None:  # one picture of both processes (one clock: CLOCK_MONOTONIC)
        merge_traces([Path(job.trace_dir) / f"exp3-rank{r}.json" for r in (0, 1)], Path(job.trace_dir) / "exp3.json")
    per_round = [stage_seconds(a, b) for a, b in zip(rank0["stages"], rank1["stages"])]
    stages = {name: [r[name] for r in per_round] for name in ("compute", "transfer", "reduce")}
    same = (torch.equal(rank1["acc_pipelined"], rank1["acc_sequential"])
            and torch.equal(rank1["acc_pipelined"], rank0["acc_reference"]))
    return {
        "measured_s": rank0["samples"]["pipelined"],
        # "In sequence" is the sum of the stages, not the wall time with acknowledgements, which
        # adds a gloo round trip per chunk that no one running in sequence would need.
        "sequential_s": [job.chunks * sum(r.values()) for r in per_round],
        "sequential_wall_s": rank0["samples"]["in sequence"],
        "ideal_s": [pipeline_bound_s(r, job.chunks) for r in per_round],
        "stages_s": stages,
        "check": {"passed": bool(same), "bitwise": True,
                  "what": "rank 1's accumulator: pipelined == in sequence == one-process reference"},
    }
