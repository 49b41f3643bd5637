"""`phalanx bench allreduce`: time every allreduce algorithm over message sizes and world sizes,
and its two halves, reduce-scatter and all-gather, for the algorithms that have them.

For each world size one spawned run (the production launcher, gloo on loopback) whose workers
time sizes x collectives x algorithms with the kit's collective method (phalanx/measure/collective.py:
warm-up calls, calibrated batches, agreed counts, a barrier before each batch, interleaved
rounds). A batch's time is the slowest rank's, since a collective is done when its last rank is.
Reduce-scatter and all-gather run on the whole buffer cut in even per-rank counts.
Bandwidths follow nccl-tests' PERFORMANCE.md, with size the whole buffer: algbw = size / time;
busbw = algbw x 2(k-1)/k for allreduce and x (k-1)/k for reduce-scatter and all-gather
(telemetry/bandwidth.py), the share of the data each rank must move, so busbw is comparable
across world sizes, collectives and a link's speed. A half's time over the allreduce's (same size and algorithm, paired per round) is
the per-byte comparison: a ring's halves each move half the allreduce's bytes (about 0.5). A
single-process memcpy into a preallocated buffer is the reference line: no collective on this
host can move bytes faster than one copy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from phalanx.comm import ALGORITHMS, AsyncComm
from phalanx.comm.ring import chunk_sizes
from phalanx.comm.shm_kernel import TEAM_NUMEL, team_is_faster
from phalanx.comm.shards import ALL_GATHER, REDUCE_SCATTER, SHARDED_ALGORITHMS
from phalanx.measure.collective import time_collectives
from phalanx.measure.flags import format_size, parse_size
from phalanx.measure.outputs import format_table, new_figure
from phalanx.measure.timing import (MAX_CALLS, TARGET_BATCH_S, Spread, calls_for, intra_op_threads, paired_ratio,
                                    run_interleaved, seconds_per_call, slowest_per_round)
from phalanx.options import Rule, at_least, check_options, option
from phalanx.runtime.binding import available_cores
from phalanx.runtime.devices import parse_devices
from phalanx.runtime.launch import LaunchSpec, launch
from phalanx.runtime.world import World
from phalanx.telemetry.bandwidth import busbw_factor

DEFAULT_SIZES_BYTES = (4 << 10, 64 << 10, 512 << 10, 1 << 20, 16 << 20, 64 << 20)
_FLOAT_BYTES = 4  # float32 buffers, as gradients are
MEMCPY_MAX_CALLS = 10_000
COLLECTIVES = ("allreduce", REDUCE_SCATTER, ALL_GATHER)


PYTHON_ROUNDS = "shm-python"  # the shm algorithm with its rounds in Python, timed beside the compiled ones
SHM_ROUNDS = ("compiled", "python")


def contenders(config: "AllreduceBenchConfig") -> list[str]:
    """The algorithms as timed: shm once for each of --shm-rounds ("shm", PYTHON_ROUNDS)."""
    named = {"compiled": "shm", "python": PYTHON_ROUNDS}
    return [variant for algo in config.algorithms
            for variant in ([named[r] for r in config.shm_rounds] if algo == "shm" else [algo])]


def timed(config: "AllreduceBenchConfig") -> list[tuple[int, str, str]]:
    """(size, collective, algorithm) of every measurement, in the order they run and print:
    reduce-scatter and all-gather only for the algorithms that have them."""
    return [(size, collective, algo) for size in config.sizes_bytes for collective in config.collectives
            for algo in contenders(config)
            if collective == "allreduce" or algo.removesuffix("-python") in SHARDED_ALGORITHMS]


@dataclass(frozen=True, kw_only=True)
class AllreduceBenchConfig:
    """time each allreduce algorithm, and reduce-scatter and all-gather, over sizes and world sizes"""

    sizes_bytes: tuple[int, ...] = option(
        DEFAULT_SIZES_BYTES, flag="--sizes", items=parse_size, help="message sizes (binary KB/MB)",
        default_text=",".join(map(format_size, DEFAULT_SIZES_BYTES)),
        check=Rule(ok=lambda size: size >= _FLOAT_BYTES and size % _FLOAT_BYTES == 0,
                   problem=f"bytes is not a positive multiple of {_FLOAT_BYTES} bytes (whole float32s)"))
    world_sizes: tuple[int, ...] = option((2, 3, 4), items=int, check=at_least(2),
                                          help="process counts, one spawned run each")
    # By default the ones this bench's one host can tell apart: hierarchical on one host is shm's
    # reduce-scatter and all-gather (across hosts: bench hosts).
    algorithms: tuple[str, ...] = option(tuple(a for a in ALGORITHMS if a != "hierarchical"), items=str,
                                         choices=ALGORITHMS, help="allreduce algorithms")
    collectives: tuple[str, ...] = option(
        COLLECTIVES, items=str, choices=COLLECTIVES,
        help=f"collectives timed (reduce-scatter and all-gather: {', '.join(SHARDED_ALGORITHMS)})")
    shm_rounds: tuple[str, ...] = option(
        ("compiled",), items=str, choices=SHM_ROUNDS,
        help=f"how shm's rounds run, each timed as its own contender: compiled (C, where a compiler is), "
             f"python ({PYTHON_ROUNDS})")
    rounds: int = option(5, check=at_least(1), help="interleaved timed rounds")
    warmup_calls: int = 2
    target_batch_s: float = TARGET_BATCH_S  # a timed batch repeats a call until about this long
    max_calls: int = MAX_CALLS
    timeout_s: float = 60.0  # bound on one collective
    deadline_s: float = 900.0  # bound on one world size's whole spawned run

    def __post_init__(self) -> None:
        check_options(self)
        if not timed(self):
            raise ValueError(f"{', '.join(self.collectives)} run on {', '.join(SHARDED_ALGORITHMS)} only, "
                             f"not on {', '.join(self.algorithms)}; add one of those to --algorithms")
        if "shm" not in self.algorithms and self.shm_rounds != ("compiled",):
            raise ValueError(f"--shm-rounds {','.join(self.shm_rounds)} times shm's rounds, and --algorithms "
                             f"{','.join(self.algorithms)} has no shm; add shm to --algorithms")
        if self.max_calls < 1:
            raise ValueError(f"max_calls must be at least 1, got {self.max_calls}")
        if self.warmup_calls < 0:
            raise ValueError(f"warmup_calls must be >= 0, got {self.warmup_calls}")


def _worker(world: World, config: AllreduceBenchConfig) -> dict[str, Any]:
    """One rank: every (size, collective, algorithm) timed by the kit's collective method."""
    # Zeros: sums stay finite (no inf/denormal slow paths) and cost the same adds as any value.
    buffers = {size: torch.zeros(size // _FLOAT_BYTES) for size in config.sizes_bytes}
    # Blocking calls on this thread; the comm owns shm's segment and the p2p algorithms' group.
    comm = AsyncComm(world=world, algorithms=config.algorithms)
    python = (AsyncComm(world=world, algorithms=("shm",), compiled_rounds=False)
              if PYTHON_ROUNDS in contenders(config) else None)
    counts = {size: chunk_sizes(size // _FLOAT_BYTES, world.world_size) for size in config.sizes_bytes}
    calls = {"allreduce": lambda c, b, n, a: c.allreduce(b, algorithm=a),
             REDUCE_SCATTER: lambda c, b, n, a: c.reduce_scatter(b, counts=n, algorithm=a),
             ALL_GATHER: lambda c, b, n, a: c.all_gather(b, counts=n, algorithm=a)}

    def call(key):
        size, collective, algo = key
        on, algo = (python, "shm") if algo == PYTHON_ROUNDS else (comm, algo)
        return lambda: calls[collective](on, buffers[size], counts[size], algo)

    try:
        timings = time_collectives({key: call(key) for key in timed(config)}, rounds=config.rounds,
                                   warmup_calls=config.warmup_calls, target_batch_s=config.target_batch_s,
                                   max_calls=config.max_calls)
        rounds = comm.shm_rounds
        if rounds == "compiled" and team_is_faster(TEAM_NUMEL):  # this thread's large rounds run on torch's ops
            rounds += (f", those of {format_size(TEAM_NUMEL * _FLOAT_BYTES)} or more on torch's ops over each rank's "
                       f"{torch.get_num_threads()} intra-op threads")
        return {**timings, "shm_rounds": rounds}
    finally:
        comm.close()
        if python is not None:
            python.close()


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
    results, ratios, halves, python_rounds = [], [], [], []
    shm_rounds: dict[int, str] = {}  # how "shm" ran its rounds, by world size: "compiled" or "Python (why)"
    keys = timed(config)
    for world_size in config.world_sizes:
        spec = LaunchSpec(plan=parse_devices(f"cpu:{world_size}", cuda_count=0), timeout_s=config.timeout_s,
                          deadline_s=config.deadline_s)
        by_rank = launch(_worker, config, spec=spec)
        if by_rank[0]["shm_rounds"] is not None:
            shm_rounds[world_size] = by_rank[0]["shm_rounds"]
        times = {key: slowest_per_round([rank["samples"][key] for rank in by_rank]) for key in keys}
        for (size, collective, algo), per_round in times.items():
            algbw = Spread.of([size / t / 1e9 for t in per_round])
            results.append({"world_size": world_size, "size_bytes": size, "collective": collective, "algorithm": algo,
                            "calls_per_batch": by_rank[0]["calls"][(size, collective, algo)],
                            "time_s": Spread.of(per_round).to_dict(), "algbw_GBps": algbw.to_dict(),
                            "busbw_GBps": algbw.scaled(busbw_factor(world_size, collective)).to_dict()})
        for size, collective, algo in keys:
            where = {"world_size": world_size, "size_bytes": size, "collective": collective, "algorithm": algo}
            native = times.get((size, collective, "native"))
            if algo != "native" and native is not None:  # busbw ratio = native time / own time, paired per round
                ratio = paired_ratio(native, times[(size, collective, algo)])
                ratios.append({**where, "busbw_vs_native": ratio.to_dict()})
            if algo == PYTHON_ROUNDS and (size, collective, "shm") in times:  # what compiling the rounds buys
                ratio = paired_ratio(times[(size, collective, algo)], times[(size, collective, "shm")])
                python_rounds.append({**where, "python_rounds_vs_compiled": ratio.to_dict()})
            allreduce = times.get((size, "allreduce", algo))
            if collective != "allreduce" and allreduce is not None:  # the per-byte comparison
                halves.append({**where, "time_vs_allreduce": paired_ratio(times[(size, collective, algo)],
                                                                         allreduce).to_dict()})
    return {
        "bench": "allreduce",
        "config": asdict(config),
        "cores": available_cores(),
        "memcpy": [{"size_bytes": size, "time_s": spread.to_dict(),
                    "algbw_GBps": Spread.of([size / t / 1e9 for t in spread.samples]).to_dict()}
                   for size, spread in memcpy.items()],
        "results": results,
        "ratios": ratios,
        "halves": halves,
        "python_rounds": python_rounds,
        "shm_rounds": shm_rounds,
    }


def report_allreduce(payload: dict[str, Any]) -> str:
    """The terminal table: per world size every (size, collective, algorithm), then own algorithm
    / native per collective, then each half's time / the allreduce's per algorithm."""
    lines = ["memcpy reference (1 process, 1 thread, preallocated destination):"]
    rows = [(format_size(m["size_bytes"]), Spread.from_dict(m["time_s"]).scaled(1e3).fmt(3),
             Spread.from_dict(m["algbw_GBps"]).fmt(2)) for m in payload["memcpy"]]
    lines += [format_table(["size", "time ms", "GB/s"], rows), ""]
    collectives = payload["config"]["collectives"]
    for world_size in payload["config"]["world_sizes"]:
        rows = [(format_size(r["size_bytes"]), r["collective"], r["algorithm"],
                 Spread.from_dict(r["time_s"]).scaled(1e3).fmt(3), Spread.from_dict(r["algbw_GBps"]).fmt(3),
                 Spread.from_dict(r["busbw_GBps"]).fmt(3), r["calls_per_batch"])
                for r in payload["results"] if r["world_size"] == world_size]
        lines.append(f"{', '.join(collectives)} on {world_size} CPU processes, median (min-max) of "
                     f"{payload['config']['rounds']} interleaved rounds:")
        lines += [format_table(["size", "collective", "algorithm", "time ms", "algbw GB/s", "busbw GB/s", "calls"],
                               rows)]
        rounds = {str(k): v for k, v in payload.get("shm_rounds", {}).items()}.get(str(world_size))
        if rounds is not None:
            ran = rounds.replace("compiled", "compiled (shm_kernel.c)", 1) if rounds.startswith("compiled") \
                else f"in {rounds}"
            lines.append(f"shm's rounds ran {ran}"
                         + (f"; {PYTHON_ROUNDS}: the same algorithm, rounds in Python" if PYTHON_ROUNDS in
                            [r['algorithm'] for r in payload['results']] else ""))
        lines.append("")
        for key, text in (("ratios", "{algo} / native busbw, {collective}, on {k} processes (>1: {algo} faster): "),
                          ("halves", "{algo} {collective} time / {algo} allreduce time on {k} processes: ")):
            for collective in collectives:
                for algo in dict.fromkeys(r["algorithm"] for r in payload["results"]):
                    own = [r for r in payload[key] if r["world_size"] == world_size and r["algorithm"] == algo
                           and r["collective"] == collective]
                    if own:
                        value = "busbw_vs_native" if key == "ratios" else "time_vs_allreduce"
                        lines.append(text.format(algo=algo, collective=collective, k=world_size) + ", ".join(
                            f"{format_size(r['size_bytes'])} {Spread.from_dict(r[value]).fmt(2)}" for r in own))
        for collective in collectives:
            compiled = [r for r in payload.get("python_rounds", []) if r["world_size"] == world_size
                        and r["collective"] == collective]
            if compiled:
                lines.append(f"{PYTHON_ROUNDS} time / shm time, {collective}, on {world_size} processes (>1: compiled "
                             "rounds faster): " + ", ".join(f"{format_size(r['size_bytes'])} "
                                                            f"{Spread.from_dict(r['python_rounds_vs_compiled']).fmt(2)}"
                                                            for r in compiled))
        lines.append("")
    return "\n".join(lines).rstrip()


def plot_allreduce(payload: dict[str, Any]):
    """busbw against message size, one panel per collective (rows) and world size (columns),
    memcpy as the ceiling line."""
    world_sizes, collectives = payload["config"]["world_sizes"], payload["config"]["collectives"]
    fig, axes = new_figure(len(world_sizes), nrows=len(collectives))
    memcpy_sizes = [m["size_bytes"] for m in payload["memcpy"]]
    memcpy_bw = [m["algbw_GBps"]["median"] for m in payload["memcpy"]]
    panels = [(collective, world_size) for collective in collectives for world_size in world_sizes]
    for ax, (collective, world_size) in zip(axes, panels):
        for algo in dict.fromkeys(r["algorithm"] for r in payload["results"]):
            rows = [r for r in payload["results"] if r["world_size"] == world_size and r["algorithm"] == algo
                    and r["collective"] == collective]
            if not rows:
                continue
            sizes = [r["size_bytes"] for r in rows]
            ax.plot(sizes, [r["busbw_GBps"]["median"] for r in rows], marker="o", label=algo)
            ax.fill_between(sizes, [r["busbw_GBps"]["min"] for r in rows], [r["busbw_GBps"]["max"] for r in rows],
                            alpha=0.2)
        ax.plot(memcpy_sizes, memcpy_bw, linestyle="--", color="gray", label="memcpy (algbw)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"{collective}, {world_size} processes", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    return fig
