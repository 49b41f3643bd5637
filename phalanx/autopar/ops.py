"""Experiments 1 and 2 on CPU: independent matrix products, as PyTorch issues them and concurrently.

Exercise 1 asks whether PyTorch runs operations with no dependencies between them in parallel by
itself; exercise 2 whether parallelism helps when each operator is small. Both are the same
measurement: k independent n x n products (`torch.mm` into preallocated outputs, so the
allocator is not timed), split round-robin into one share per lane.

- "eager": one after another on the calling thread, each product using every core (intra-op
  parallelism, PyTorch's default): what PyTorch does by itself. The "in sequence" time.
- "each alone, summed" (experiment 1): every product timed on its own and summed. Eager equal to
  this sum means nothing ran at the same time.
- "concurrent": the shares at once, one lane thread each with one intra-op thread, so both
  contenders use the same cores (ThreadLanes; the ops release the GIL).
- "share i alone": one share on its lane with the others idle; the longest is the ideal
  (the longest independent part).

Every contender repeats its products `repeats` times per sample, calibrated so that one core
doing all of them takes about `target_s` (a 32 x 32 product takes microseconds). The check: the
concurrent outputs are bitwise those of the same products one after another with the same
intra-op thread count.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from phalanx.autopar.trace import label, profiled
from phalanx.autopar.taskgraph import ThreadLanes
from phalanx.measure.timing import calls_for, intra_op_threads, run_interleaved, timed

MAX_REPEATS = 20_000


class Products:
    """k independent products of size n, their outputs, and their split into lane shares."""

    def __init__(self, *, size: int, count: int, lanes: int, dtype: str, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed + size)
        dt = getattr(torch, dtype)
        self.inputs = [torch.randn(size, size, generator=g, dtype=dt) / size ** 0.5 for _ in range(count)]
        self.outputs = [torch.empty(size, size, dtype=dt) for _ in range(count)]
        self.shares = [list(range(lane, count, lanes)) for lane in range(lanes)]
        self.repeats = 1

    def run(self, indices, repeats: int | None = None) -> None:
        for _ in range(self.repeats if repeats is None else repeats):
            for i in indices:
                torch.mm(self.inputs[i], self.inputs[i], out=self.outputs[i])

    def calibrate(self, target_s: float, lanes: ThreadLanes, *, deadline_s: float) -> int:
        """Pick `repeats` so that all products on one core, one after another, take about `target_s`.
        Timed on one lane thread: unlike an all-core run, it does not stall when another process
        takes a core away from one of its threads (a shared machine does that). The repeats double
        until a timing lasts a quarter of the target, so handing work to the lane (tens of
        microseconds) does not pass for the products' own time."""
        everything = range(len(self.inputs))
        lanes.run_all({lanes.names[0]: lambda: self.run(everything, 1)}, deadline_s=deadline_s)  # warm-up
        repeats = 1
        while True:
            elapsed_s = timed(lambda: lanes.run_all({lanes.names[0]: lambda: self.run(everything, repeats)},
                                                    deadline_s=deadline_s))()
            if elapsed_s >= target_s / 4 or repeats >= MAX_REPEATS:
                break
            repeats *= 2
        self.repeats = calls_for(elapsed_s / repeats, target_batch_s=target_s, max_calls=MAX_REPEATS)
        return self.repeats


def contenders(products: Products, lanes: ThreadLanes, *, cores: int, deadline_s: float,
               each_alone: bool) -> dict[str, Callable[[], float]]:
    """The timed runs of experiments 1 and 2, by name (see the module docstring)."""
    everything = range(len(products.inputs))

    def eager() -> None:
        with intra_op_threads(cores), label("eager @main"):
            products.run(everything)

    def concurrent() -> None:
        lanes.run_all({lane: _share(products, share, f"share {i} @{lane}") for i, (lane, share)
                       in enumerate(zip(lanes.names, products.shares))}, deadline_s=deadline_s)

    runs = {"eager": timed(eager), "concurrent": timed(concurrent)}
    if each_alone:
        def each_alone_summed() -> float:
            with intra_op_threads(cores):
                return sum(timed(lambda i=i: products.run([i]))() for i in everything)
        runs["each alone, summed"] = each_alone_summed
    for i, (lane, share) in enumerate(zip(lanes.names, products.shares)):
        runs[f"share {i} alone"] = timed(lambda lane=lane, share=share, i=i: lanes.run_all(
            {lane: _share(products, share, f"share-alone {i} @{lane}")}, deadline_s=deadline_s))
    return runs


def _share(products: Products, share: list[int], name: str) -> Callable[[], None]:
    def run() -> None:
        with label(name):
            products.run(share)
    return run


def check_bitwise(products: Products, lanes: ThreadLanes, *, deadline_s: float) -> dict[str, Any]:
    """Concurrent outputs vs the same products one after another on one lane (same thread count)."""
    lanes.run_all({lane: (lambda share=share: products.run(share, 1)) for lane, share
                   in zip(lanes.names, products.shares)}, deadline_s=deadline_s)
    concurrent = [out.clone() for out in products.outputs]
    for out in products.outputs:
        out.fill_(float("nan"))  # a product that did not run cannot pass by leftover values
    lanes.run_all({lanes.names[0]: lambda: products.run(range(len(products.inputs)), 1)}, deadline_s=deadline_s)
    same = all(torch.equal(a, b) for a, b in zip(concurrent, products.outputs))
    return {"passed": bool(same), "bitwise": True,
            "what": "concurrent outputs == the same products one after another, one intra-op thread"}


def measure_cpu(*, size: int, count: int, cores: int, lanes: int, rounds: int, target_s: float, dtype: str,
                each_alone: bool, deadline_s: float, trace: tuple[str, str] | None = None) -> dict[str, Any]:
    """One size: every contender's samples, the repeats used, the check; traced if asked."""
    products = Products(size=size, count=count, lanes=lanes, dtype=dtype)
    with ThreadLanes([f"lane{i}" for i in range(lanes)], intra_op_threads=1) as pool:
        repeats = products.calibrate(target_s, pool, deadline_s=deadline_s)
        runs = contenders(products, pool, cores=cores, deadline_s=deadline_s, each_alone=each_alone)
        samples = run_interleaved(runs, rounds=rounds, warmup_rounds=1)
        check = check_bitwise(products, pool, deadline_s=deadline_s)
        if trace is not None:
            products.repeats = 1  # one pass of each contender is enough to see it
            with profiled(trace[0], trace[1]):
                for run in runs.values():
                    run()
    return {"size": size, "count": count, "repeats": repeats, "samples": samples, "check": check}
