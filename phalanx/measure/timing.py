"""The measuring method every phalanx benchmark shares: warm-up then timed repeats, calibrated
batches, interleaved rounds, the slowest rank's time, the median with its min-max spread, paired
ratios, and the --device choice with its per-device default sizes.

The method (STYLE.md habit 10, nanoGPT's bench.py): warm up first, then time; run the things
being compared in the same invocation, interleaved A B A B ... round by round, so drift on a
shared machine (another job, thermal state, page cache) hits every contender alike; report the
median and the min-max of the rounds, never one number. A comparison is the median of the
per-round ratios (A_i / B_i), which cancels drift that a ratio of two medians would keep. A
call too short for the clock is repeated into a batch of about `target_batch_s` (`calls_for`).
What this module does not know: what is being timed, or how processes are started (step.py,
collective.py, procs.py). It does set the one thing a timed run on CPU depends on beside the
work: the intra-op thread count.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator, Mapping, Sequence, TypeVar

import torch

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)
TARGET_BATCH_S = 0.02  # a timed batch repeats a short call until about this long (clock resolution, noise)
MAX_CALLS = 50  # ... but at most this many calls: a slow call is timed once per round


@dataclass(frozen=True, kw_only=True)
class Spread:
    """Median and min-max of the samples of one measurement (one sample per round)."""

    median: float
    min: float
    max: float
    samples: tuple[float, ...]

    @classmethod
    def of(cls, samples: Sequence[float]) -> "Spread":
        if not samples:
            raise ValueError("a spread needs at least one sample, got none")
        values = tuple(float(s) for s in samples)
        return cls(median=statistics.median(values), min=min(values), max=max(values), samples=values)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Spread":
        return cls.of(data["samples"])

    def scaled(self, factor: float) -> "Spread":
        return Spread.of([s * factor for s in self.samples])

    def to_dict(self) -> dict[str, Any]:
        return {"median": self.median, "min": self.min, "max": self.max, "samples": list(self.samples)}

    def fmt(self, digits: int = 2) -> str:
        return f"{self.median:.{digits}f} ({self.min:.{digits}f}-{self.max:.{digits}f})"


def interleave(names: Sequence[T], rounds: int) -> list[tuple[int, T]]:
    """(round, name) in the order to run them: every name once per round, A B A B ..."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    return [(r, name) for r in range(rounds) for name in names]


def run_interleaved(runs: Mapping[K, Callable[[], T]], *, rounds: int, warmup_rounds: int = 1) -> dict[K, list[T]]:
    """Call every run once per round, interleaved; the warm-up rounds are run and discarded. A
    run returns its sample: seconds, or whatever its processes report (bench memory's records)."""
    for _, name in interleave(list(runs), warmup_rounds) if warmup_rounds else []:
        runs[name]()
    samples: dict[K, list[T]] = {name: [] for name in runs}
    for _, name in interleave(list(runs), rounds):
        samples[name].append(runs[name]())
    return samples


def timed(work: Callable[[], object], *, sync: Callable[[], object] | None = None) -> Callable[[], float]:
    """`work` as a timed run for run_interleaved: seconds from one `sync` to the next. The sync
    (a barrier, cuda.synchronize) makes the clock start when everyone is ready and stop when the
    last one is done, not when an asynchronous launch returns."""
    def run() -> float:
        if sync is not None:
            sync()
        start_s = time.perf_counter()
        work()
        if sync is not None:
            sync()
        return time.perf_counter() - start_s
    return run


def device_and_sizes(config: Any, defaults: Mapping[str, Mapping[str, Any]]) -> tuple[str, dict[str, Any]]:
    """A bench config's device made definite - `auto` is cuda when torch sees a GPU, else cpu, and
    cuda without one is refused - and the sizes it left None taken from that device's `defaults`."""
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda asked for, but torch sees no GPU; use --device cpu")
    sizes = {name: value if getattr(config, name) is None else getattr(config, name)
             for name, value in defaults[device].items()}
    return device, sizes


def per_device(defaults: Mapping[str, Mapping[str, Any]], name: str) -> str:
    """How --help shows a size `device_and_sizes` fills in: 'cpu 512, cuda 4096'."""
    return ", ".join(f"{device} {sizes[name]}" for device, sizes in defaults.items())


def synchronize_cuda() -> None:
    """Wait for every GPU's queued work (cuda.synchronize waits for the current device only)."""
    for index in range(torch.cuda.device_count()):
        torch.cuda.synchronize(index)


@contextlib.contextmanager
def intra_op_threads(threads: int) -> Iterator[None]:
    """PyTorch's intra-op thread count for the block, restored after. The setting is process-wide
    in practice (OpenMP and MKL take it from the last call), so contenders that need different
    counts each set theirs as they start."""
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def seconds_per_call(fn: Callable[[], object], iters: int, *, sync: Callable[[], None] | None = None) -> float:
    """Mean wall time of `iters` back-to-back calls; `sync` (e.g. cuda.synchronize) ends the clock."""
    if iters < 1:
        raise ValueError(f"iters must be at least 1, got {iters}")
    start_s = time.perf_counter()
    for _ in range(iters):
        fn()
    if sync is not None:
        sync()
    return (time.perf_counter() - start_s) / iters


def calls_for(estimate_s: float, *, target_batch_s: float = TARGET_BATCH_S, max_calls: int = MAX_CALLS) -> int:
    """Calibration: how many calls of about `estimate_s` each make a timed batch of about
    `target_batch_s` (at least 1, at most `max_calls`)."""
    return max(1, min(max_calls, math.ceil(target_batch_s / max(estimate_s, 1e-9))))


def slowest_per_round(by_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per round, the slowest rank's seconds: a lockstep step or a collective is done when its
    last rank is. `by_rank[r][i]` is rank r's sample of round i."""
    if not by_rank or len({len(samples) for samples in by_rank}) != 1:
        raise ValueError(f"every rank needs the same number of rounds, got {[len(s) for s in by_rank]}")
    return [max(samples) for samples in zip(*by_rank)]


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> Spread:
    """Spread of the per-round ratios a_i / b_i (the rounds of a and b ran side by side)."""
    if len(numerator) != len(denominator):
        raise ValueError(f"paired samples differ in length: {len(numerator)} vs {len(denominator)}")
    return Spread.of([a / b for a, b in zip(numerator, denominator)])
