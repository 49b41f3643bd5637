"""Experiments 1, 2 and 3 on a GPU: products on one stream or several, and a GPU-copy-CPU pipeline.

1 and 2 (see autopar_ops.py for the CPU twin): k independent n x n products on cuda:0, "eager"
on the current stream (kernels queue and run one after another), "concurrent" split round-robin
over `streams` CUDA streams, "share i alone" on its stream with the others idle, "batched" all k
as one `bmm` kernel (the device's own bound: streams share one GPU, and no arrangement of them
does the work faster than the GPU runs it all at once; one 4096^2 product already fills an H200,
where the longest share alone promised 4 lanes' worth), and for experiment 1 "each alone,
summed" (synchronize after every product). The ideal is the longer of the longest share alone
and the batched kernel (exercises.py). Every
contender starts and ends with a synchronize. The check: the concurrent outputs are bitwise the
one-stream outputs (same kernels, same inputs).

3, the exercise as the chapter means it: the GPU computes chunk i (`depth` products) on a compute
stream while the copy engine moves chunk i-1 into pinned host memory on a copy stream
(non-blocking) while the CPU reduces chunk i-2 (column sums into an accumulator); events order
them, two device slots and three host slots keep a chunk from being overwritten while in use.
In sequence: compute, synchronize, copy, reduce, chunk by chunk, each stage timed: the ideal is
the pipeline bound of autopar_pipeline.py. The check: the accumulators of both runs are bitwise
equal. Written without a GPU at hand (tests/gpu/test_autopar_cuda.py runs it where one is).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from phalanx.autopar.pipeline import pipeline_bound_s
from phalanx.autopar.trace import label, profiled
from phalanx.measure.timing import calls_for, run_interleaved, synchronize_cuda, timed

MAX_REPEATS = 20_000
EVENT_DEADLINE_S = 60.0


def _synced(fn: Callable[[], object]) -> Callable[[], float]:
    return timed(fn, sync=synchronize_cuda)  # kernels are asynchronous: a sample ends when they are done


def wait_event(event: torch.cuda.Event, *, deadline_s: float = EVENT_DEADLINE_S) -> None:
    """event.synchronize() with a deadline: a hung GPU fails the run instead of stalling it."""
    end = time.monotonic() + deadline_s
    while not event.query():
        if time.monotonic() > end:
            raise RuntimeError(f"a CUDA event was not reached within {deadline_s:g} s")
        time.sleep(0)


def measure_streams(*, size: int, count: int, streams: int, rounds: int, target_s: float, dtype: str,
                    each_alone: bool, trace: tuple[str, str] | None = None) -> dict[str, Any]:
    device = torch.device("cuda:0")
    g = torch.Generator().manual_seed(size)
    inputs = [(torch.randn(size, size, generator=g, dtype=getattr(torch, dtype)) / size ** 0.5).to(device)
              for _ in range(count)]
    outputs = [torch.empty_like(x) for x in inputs]
    stacked, stacked_out = torch.stack(inputs), torch.empty(count, size, size, dtype=inputs[0].dtype, device=device)
    lanes = [torch.cuda.Stream(device=device) for _ in range(streams)]
    shares = [list(range(s, count, streams)) for s in range(streams)]
    repeats = [1]

    def run(indices) -> None:
        for _ in range(repeats[0]):
            for i in indices:
                torch.mm(inputs[i], inputs[i], out=outputs[i])

    def on(stream: torch.cuda.Stream, indices, name: str) -> None:
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), label(name):
            run(indices)

    def eager() -> None:
        with label("eager @main"):
            run(range(count))

    def concurrent() -> None:
        for i, (stream, share) in enumerate(zip(lanes, shares)):
            on(stream, share, f"share {i} @stream{i}")  # launches return at once: every stream is fed in turn

    def batched() -> None:  # the device's bound: every product in one kernel, filling the GPU as it can
        with label("batched @main"):
            for _ in range(repeats[0]):
                torch.bmm(stacked, stacked, out=stacked_out)

    synchronize_cuda()
    _synced(eager)()  # warm: cuBLAS handles and workspaces per stream
    once_s = max(_synced(eager)(), 1e-7)
    repeats[0] = calls_for(once_s, target_batch_s=target_s, max_calls=MAX_REPEATS)
    runs = {"eager": _synced(eager), "concurrent": _synced(concurrent), "batched": _synced(batched)}
    if each_alone:
        runs["each alone, summed"] = lambda: sum(_synced(lambda i=i: run([i]))() for i in range(count))
    for i, (stream, share) in enumerate(zip(lanes, shares)):
        runs[f"share {i} alone"] = _synced(
            lambda stream=stream, share=share, i=i: on(stream, share, f"share-alone {i} @stream{i}"))
    samples = run_interleaved(runs, rounds=rounds, warmup_rounds=1)
    used, repeats[0] = repeats[0], 1
    _synced(concurrent)()
    concurrent_out = [o.clone() for o in outputs]
    for o in outputs:
        o.fill_(float("nan"))
    _synced(eager)()
    same = all(torch.equal(a, b) for a, b in zip(concurrent_out, outputs))
    if trace is not None:
        with profiled(trace[0], trace[1], cuda=True):
            for fn in runs.values():
                fn()
    return {"size": size, "count": count, "repeats": used, "samples": samples,
            "check": {"passed": bool(same), "bitwise": True,
                      "what": "outputs on several streams == the same products on one stream"}}


def measure_pipeline(*, chunks: int, chunk_rows: int, width: int, rounds: int, dtype: str,
                     trace_dir: str | None = None, depth: int = 8) -> dict[str, Any]:
    device = torch.device("cuda:0")
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(chunk_rows, width, generator=g, dtype=dt).to(device) for _ in range(chunks)]
    w = (torch.randn(width, width, generator=g, dtype=dt) / width ** 0.5).to(device)
    dev_slots = [torch.empty(chunk_rows, width, dtype=dt, device=device) for _ in range(2)]
    scratch = [torch.empty(chunk_rows, width, dtype=dt, device=device) for _ in range(2)]
    host_slots = [torch.empty(chunk_rows, width, dtype=dt, pin_memory=True) for _ in range(3)]
    column_sums = torch.empty(width, dtype=dt)
    acc = torch.zeros(width, dtype=dt)
    compute_stream, copy_stream = torch.cuda.Stream(device=device), torch.cuda.Stream(device=device)
    stages: list[dict[str, float]] = []

    def compute(i: int, slot: int) -> None:
        with label(f"compute {i}"):
            torch.mm(xs[i], w, out=dev_slots[slot])
            for _ in range(depth - 1):  # ping-pong through scratch: `depth` products per chunk
                torch.mm(dev_slots[slot], w, out=scratch[slot])
                dev_slots[slot].copy_(scratch[slot])

    def reduce(host: torch.Tensor, i: int) -> None:
        with label(f"reduce {i}"):
            torch.sum(host, dim=0, out=column_sums)
            acc.add_(column_sums)

    def sequential() -> None:
        times = {"compute": [], "transfer": [], "reduce": []}
        for i in range(chunks):
            t = time.perf_counter()
            compute(i, 0)
            synchronize_cuda()
            times["compute"].append(time.perf_counter() - t)
            t = time.perf_counter()
            host_slots[0].copy_(dev_slots[0])
            times["transfer"].append(time.perf_counter() - t)
            t = time.perf_counter()
            reduce(host_slots[0], i)
            times["reduce"].append(time.perf_counter() - t)
        stages.append({name: statistics.median(v) for name, v in times.items()})

    def pipelined() -> None:
        computed = [torch.cuda.Event() for _ in range(chunks)]
        copied = [torch.cuda.Event() for _ in range(chunks)]
        compute_stream.wait_stream(torch.cuda.current_stream(device))
        for step in range(chunks + 2):
            i, j, k = step, step - 1, step - 2
            if i < chunks:
                with torch.cuda.stream(compute_stream):
                    if i >= 2:
                        compute_stream.wait_event(copied[i - 2])  # device slot i % 2 has been copied out
                    compute(i, i % 2)
                    computed[i].record(compute_stream)
            if 0 <= j < chunks:
                with torch.cuda.stream(copy_stream), label(f"copy {j}"):
                    copy_stream.wait_event(computed[j])
                    host_slots[j % 3].copy_(dev_slots[j % 2], non_blocking=True)  # pinned: the copy engine
                    copied[j].record(copy_stream)
            if 0 <= k < chunks:
                wait_event(copied[k])
                reduce(host_slots[k % 3], k)

    def zeroed(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            acc.zero_()
            fn()
        return run

    samples = run_interleaved({"in sequence": _synced(zeroed(sequential)), "pipelined": _synced(zeroed(pipelined))},
                              rounds=rounds, warmup_rounds=1)
    per_round = stages[1:]  # the warm-up round's stages go with its time
    _synced(zeroed(pipelined))()
    acc_pipelined = acc.clone()
    _synced(zeroed(sequential))()
    same = torch.equal(acc_pipelined, acc)
    if trace_dir is not None:
        with profiled(trace_dir, "exp3", cuda=True):
            _synced(zeroed(sequential))()
            _synced(zeroed(pipelined))()
    return {"measured_s": samples["pipelined"],
            "sequential_s": [chunks * sum(r.values()) for r in per_round[:rounds]],
            "sequential_wall_s": samples["in sequence"],
            "ideal_s": [pipeline_bound_s(r, chunks) for r in per_round[:rounds]],
            "stages_s": {name: [r[name] for r in per_round[:rounds]] for name in ("compute", "transfer", "reduce")},
            "check": {"passed": bool(same), "bitwise": True,
                      "what": "the CPU's accumulator: pipelined == in sequence"}}
