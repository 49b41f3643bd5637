"""`phalanx bench allreduce`: time every allreduce algorithm over message sizes and world sizes.

For each world size one spawned run (the production launcher, gloo on loopback) whose workers
time sizes x algorithms with the kit's collective method (phalanx/measure/collective.py: warm-up
calls, calibrated batches, agreed counts, a barrier before each batch, interleaved rounds). A
batch's time is the slowest rank's, since an allreduce is done when its last rank is.
Bandwidths follow nccl-tests' PERFORMANCE.md: algbw = size / time; busbw = algbw x 2(k-1)/k for
allreduce, the share of the data each rank must move, so busbw is comparable across world sizes
and against a link's speed. A single-process memcpy into a preallocated buffer is the
reference line: no allreduce on this host can move bytes faster than one copy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from phalanx.comm import ALGORITHMS, AsyncComm
from phalanx.measure.collective import time_collectives
from phalanx.measure.flags import format_size
from phalanx.measure.outputs import format_table, new_figure
from phalanx.measure.timing import (MAX_CALLS, TARGET_BATCH_S, Spread, calls_for, intra_op_threads, paired_ratio,
                                    run_interleaved, seconds_per_call, slowest_per_round)
from phalanx.runtime.binding import available_cores
from phalanx.runtime.devices import parse_devices
from phalanx.runtime.launch import LaunchSpec, launch
from phalanx.runtime.world import World

DEFAULT_SIZES_BYTES = (4 << 10, 64 << 10, 512 << 10, 1 << 20, 16 << 20, 64 << 20)
_FLOAT_BYTES = 4  # float32 buffers, as gradients are
MEMCPY_MAX_CALLS = 10_000


def busbw_factor(world_size: int) -> float:
    """nccl-tests PERFORMANCE.md, allreduce: busbw = algbw * 2(n-1)/n."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    return 2.0 * (world_size - 1) / world_size


@dataclass(frozen=True, kw_only=True)
class AllreduceBenchConfig:
    sizes_bytes: tuple[int, ...] = DEFAULT_SIZES_BYTES
    world_sizes: tuple[int, ...] = (2, 3, 4)
    algorithms: tuple[str, ...] = ALGORITHMS
    rounds: int = 5
    warmup_calls: int = 2
    target_batch_s: float = TARGET_BATCH_S  # a timed batch repeats a call until about this long
    max_calls: int = MAX_CALLS
    timeout_s: float = 60.0  # bound on one collective
    deadline_s: float = 900.0  # bound on one world size's whole spawned run

    def __post_init__(self) -> None:
        odd = [s for s in self.sizes_bytes if s < _FLOAT_BYTES or s % _FLOAT_BYTES]
        if not self.sizes_bytes or odd:
            raise ValueError(f"sizes must be positive multiples of {_FLOAT_BYTES} bytes (whole float32s), "
                             f"got {list(self.sizes_bytes)}")
        if not self.world_sizes or min(self.world_sizes) < 2:
            raise ValueError(f"world sizes must be at least 2, got {list(self.world_sizes)}")
        unknown = [a for a in self.algorithms if a not in ALGORITHMS]
        if not self.algorithms or unknown:
            raise ValueError(f"unknown algorithms {unknown}; choose from {', '.join(ALGORITHMS)}")
        for name in ("rounds", "max_calls"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.warmup_calls < 0:
            raise ValueError(f"warmup_calls must be >= 0, got {self.warmup_calls}")


def _worker(world: World, config: AllreduceBenchConfig) -> dict[str, Any]:
    """One rank: every (size, algorithm) timed by the kit's collective method."""
    # Zeros: sums stay finite (no inf/denormal slow paths) and cost the same adds as any value.
    buffers = {size: torch.zeros(size // _FLOAT_BYTES) for size in config.sizes_bytes}
    # Blocking calls on this thread; the comm owns shm's segment and the p2p algorithms' group.
    comm = AsyncComm(world=world, algorithms=config.algorithms)
    try:
        return time_collectives(
            {(size, algo): (lambda b=buffers[size], a=algo: comm.allreduce(b, algorithm=a))
             for size in config.sizes_bytes for algo in config.algorithms},
            rounds=config.rounds, warmup_calls=config.warmup_calls, target_batch_s=config.target_batch_s,
            max_calls=config.max_calls)
    finally:
        comm.close()


def memcpy_reference(config: AllreduceBenchConfig) -> dict[int, Spread]:
    """Seconds per copy into a preallocated buffer, one thread, sizes interleaved, in this process."""
    with intra_op_threads(1):  # one worker's share of the machine
        pairs = {size: (torch.ones(size // _FLOAT_BYTES), torch.empty(size // _FLOAT_BYTES))
                 for size in config.sizes_bytes}
        copies = {size: (lambda s=src, d=dst: d.copy_(s)) for size, (src, dst) in pairs.items()}
        # A 4 KB copy takes ~1 us: allow enough calls that the clock, not the copy, is negligible.
        calls = {size: calls_for(seconds_per_call(fn, 1), target_batch_s=config.target_batch_s,
                                 max_calls=MEMCPY_MAX_CALLS) for size, fn in copies.items()}
        runs = {size: (lambda s=size: seconds_per_call(copies[s], calls[s])) for size in copies}
        samples = run_interleaved(runs, rounds=config.rounds, warmup_rounds=1)
    return {size: Spread.of(samples[size]) for size in config.sizes_bytes}


def run_allreduce_bench(config: AllreduceBenchConfig) -> dict[str, Any]:
    """Measure everything; return the JSON payload (times in s, bandwidths in GB/s = 1e9 B/s)."""
    memcpy = memcpy_reference(config)
    results, ratios = [], []
    keys = [(size, algo) for size in config.sizes_bytes for algo in config.algorithms]
    for world_size in config.world_sizes:
        spec = LaunchSpec(plan=parse_devices(f"cpu:{world_size}", cuda_count=0), timeout_s=config.timeout_s,
                          deadline_s=config.deadline_s)
        by_rank = launch(_worker, config, spec=spec)
        times: dict[tuple[int, str], list[float]] = {}
        for size, algo in keys:
            per_round = slowest_per_round([rank["samples"][(size, algo)] for rank in by_rank])
            times[(size, algo)] = per_round
            time_s = Spread.of(per_round)
            algbw = Spread.of([size / t / 1e9 for t in per_round])
            results.append({"world_size": world_size, "size_bytes": size, "algorithm": algo,
                            "calls_per_batch": by_rank[0]["calls"][(size, algo)], "time_s": time_s.to_dict(),
                            "algbw_GBps": algbw.to_dict(),
                            "busbw_GBps": algbw.scaled(busbw_factor(world_size)).to_dict()})
        if "native" in config.algorithms:
            for size, algo in keys:
                if algo != "native":  # busbw ratio = native time / own time, paired per round
                    ratio = paired_ratio(times[(size, "native")], times[(size, algo)])
                    ratios.append({"world_size": world_size, "size_bytes": size, "algorithm": algo,
                                   "busbw_vs_native": ratio.to_dict()})
    return {
        "bench": "allreduce",
        "config": asdict(config),
        "cores": available_cores(),
        "memcpy": [{"size_bytes": size, "time_s": spread.to_dict(),
                    "algbw_GBps": Spread.of([size / t / 1e9 for t in spread.samples]).to_dict()}
                   for size, spread in memcpy.items()],
        "results": results,
        "ratios": ratios,
    }


def report_allreduce(payload: dict[str, Any]) -> str:
    """The terminal table: per world size every (size, algorithm), then own algorithm / native."""
    lines = ["memcpy reference (1 process, 1 thread, preallocated destination):"]
    rows = [(format_size(m["size_bytes"]), Spread.from_dict(m["time_s"]).scaled(1e3).fmt(3),
             Spread.from_dict(m["algbw_GBps"]).fmt(2)) for m in payload["memcpy"]]
    lines += [format_table(["size", "time ms", "GB/s"], rows), ""]
    for world_size in payload["config"]["world_sizes"]:
        rows = [(format_size(r["size_bytes"]), r["algorithm"], Spread.from_dict(r["time_s"]).scaled(1e3).fmt(3),
                 Spread.from_dict(r["algbw_GBps"]).fmt(3), Spread.from_dict(r["busbw_GBps"]).fmt(3),
                 r["calls_per_batch"]) for r in payload["results"] if r["world_size"] == world_size]
        lines.append(f"allreduce on {world_size} CPU processes, median (min-max) of "
                     f"{payload['config']['rounds']} interleaved rounds:")
        lines += [format_table(["size", "algorithm", "time ms", "algbw GB/s", "busbw GB/s", "calls"], rows), ""]
        for algo in payload["config"]["algorithms"]:
            own = [r for r in payload["ratios"] if r["world_size"] == world_size and r["algorithm"] == algo]
            if own:
                lines.append(f"{algo} / native busbw on {world_size} processes (>1: {algo} faster): " + ", ".join(
                    f"{format_size(r['size_bytes'])} {Spread.from_dict(r['busbw_vs_native']).fmt(2)}" for r in own))
        lines.append("")
    return "\n".join(lines).rstrip()


def plot_allreduce(payload: dict[str, Any]):
    """busbw against message size, one panel per world size, memcpy as the ceiling line."""
    world_sizes = payload["config"]["world_sizes"]
    fig, axes = new_figure(len(world_sizes))
    memcpy_sizes = [m["size_bytes"] for m in payload["memcpy"]]
    memcpy_bw = [m["algbw_GBps"]["median"] for m in payload["memcpy"]]
    for ax, world_size in zip(axes, world_sizes):
        for algo in payload["config"]["algorithms"]:
            rows = [r for r in payload["results"] if r["world_size"] == world_size and r["algorithm"] == algo]
            sizes = [r["size_bytes"] for r in rows]
            ax.plot(sizes, [r["busbw_GBps"]["median"] for r in rows], marker="o", label=algo)
            ax.fill_between(sizes, [r["busbw_GBps"]["min"] for r in rows], [r["busbw_GBps"]["max"] for r in rows],
                            alpha=0.2)
        ax.plot(memcpy_sizes, memcpy_bw, linestyle="--", color="gray", label="memcpy (algbw)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"allreduce, {world_size} processes", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    return fig
