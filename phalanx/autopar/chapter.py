"""`phalanx bench overlap`: the chapter's two experiments on automatic parallelism, measured.

(a) Two workloads on two devices, each alone and then both at once (D2L 13.2, "Parallel
Computation on GPUs"): the sum of the parts against running together. On CPU the devices are two
spawned processes with one thread each; on GPU two GPUs driven from one process (skipped with
fewer than two). (b) Computing while communicating (D2L 13.2, "Parallel Computation and
Communication"): a matmul loop and a transfer, alone and overlapped. On CPU the transfer is an
async allreduce of a large buffer through `AsyncComm` in a 2-process world, which is what
phalanx's bucketed overlap relies on; on GPU a non-blocking copy to pinned host memory on a side
stream. Every phase starts and ends at a barrier (CPU) or a synchronize (GPU); phases are
interleaved round by round after a warm-up round, and "sum of parts / together" is the median
of per-round ratios: 2.0 would be perfect overlap of two equal parts, 1.0 none.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from phalanx.comm import ALGORITHMS, AsyncComm
from phalanx.measure.outputs import format_table, new_figure
from phalanx.measure.timing import (Spread, device_and_sizes, paired_ratio, per_device, run_interleaved,
                                    synchronize_cuda, timed)
from phalanx.options import at_least, check_options, option, positive
from phalanx.runtime.devices import parse_devices
from phalanx.runtime.launch import LaunchSpec, launch
from phalanx.runtime.world import World

_MB = 1024 * 1024
# Sizes at which the two parts take similar time: a 512 matmul is ~3.4 ms on one core, a 64 MB
# gloo allreduce ~53 ms (2 processes, loopback). GPU: D2L's 4000 x 4000 matmuls; ten fp32 ones on an
# H100-class GPU take ~30 ms, about a 512 MB copy to pinned memory at ~25 GB/s (estimates).
_DEFAULTS = {"cpu": {"matrix_size": 512, "matmuls": 16, "transfer_mb": 64.0},
             "cuda": {"matrix_size": 4096, "matmuls": 10, "transfer_mb": 512.0}}


@dataclass(frozen=True, kw_only=True)
class OverlapBenchConfig:
    """two devices at once; compute while communicating"""

    device: str = option("auto", choices=("auto", "cpu", "cuda"), help="auto: cuda when torch sees a GPU, else cpu")
    # None: the device's size in _DEFAULTS (`resolved`)
    matrix_size: int | None = option(None, default_text=per_device(_DEFAULTS, "matrix_size"),
                                     check=at_least(1), help="matmul side")
    matmuls: int | None = option(None, default_text=per_device(_DEFAULTS, "matmuls"), check=at_least(1),
                                 help="matmuls per compute phase")
    transfer_mb: float | None = option(None, default_text=per_device(_DEFAULTS, "transfer_mb"),
                                       check=positive("number of MB"), help="allreduce / copy size in MB")
    algorithm: str = option("native", choices=ALGORITHMS, help="the allreduce overlapped on CPU")
    rounds: int = option(5, check=at_least(1), help="interleaved rounds")
    timeout_s: float = 60.0
    deadline_s: float = 300.0

    def __post_init__(self) -> None:
        check_options(self)

    def resolved(self) -> "OverlapBenchConfig":
        """Device picked and every size filled in."""
        device, sizes = device_and_sizes(self, _DEFAULTS)
        return OverlapBenchConfig(**{**asdict(self), "device": device, **sizes})


def _matmul_loop(config: OverlapBenchConfig, device: torch.device) -> Callable[[], None]:
    a = torch.rand(config.matrix_size, config.matrix_size, device=device)
    out = torch.empty_like(a)  # preallocated: time the arithmetic, not the allocator

    def compute() -> None:
        for _ in range(config.matmuls):
            torch.mm(a, a, out=out)
    return compute


def _cpu_worker(world: World, config: OverlapBenchConfig) -> dict[str, list[float]]:
    compute = _matmul_loop(config, world.device)
    buffer = torch.zeros(int(config.transfer_mb * _MB) // 4)
    comm = AsyncComm(world=world, algorithms=(config.algorithm,))

    def phase(work: Callable[[], None]) -> Callable[[], float]:
        return timed(work, sync=dist.barrier)  # a phase ends when both processes are done

    def together() -> None:
        handle = comm.allreduce_async(buffer, algorithm=config.algorithm)
        compute()  # runs while the allreduce moves bytes (gloo's threads / AsyncComm's thread)
        handle.wait()

    try:
        return run_interleaved({
            "a/device 0 alone": phase(lambda: compute() if world.rank == 0 else None),
            "a/device 1 alone": phase(lambda: compute() if world.rank == 1 else None),
            "a/together": phase(compute),
            "b/compute": phase(compute),
            "b/allreduce": phase(lambda: comm.allreduce_async(buffer, algorithm=config.algorithm).wait()),
            "b/together": phase(together),
        }, rounds=config.rounds, warmup_rounds=1)
    finally:
        comm.close()


def _cuda_phases(config: OverlapBenchConfig) -> dict[str, Callable[[], float]]:
    """GPU phases in this process; (a) only with two GPUs."""
    def phase(work: Callable[[], None]) -> Callable[[], float]:
        return timed(work, sync=synchronize_cuda)  # kernels and copies are asynchronous: ends when all are done

    phases = {}
    if torch.cuda.device_count() >= 2:
        gpu0, gpu1 = _matmul_loop(config, torch.device("cuda:0")), _matmul_loop(config, torch.device("cuda:1"))

        def both() -> None:
            gpu0()  # kernel launches return at once, so gpu1's work is queued while gpu0 runs
            gpu1()
        phases.update({"a/device 0 alone": phase(gpu0), "a/device 1 alone": phase(gpu1), "a/together": phase(both)})
    compute = _matmul_loop(config, torch.device("cuda:0"))
    source = torch.rand(int(config.transfer_mb * _MB) // 4, device="cuda:0")
    host = torch.empty(source.shape, pin_memory=True)  # pinned: the copy engine can DMA it asynchronously
    side = torch.cuda.Stream(device="cuda:0")

    def copy() -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            host.copy_(source, non_blocking=True)

    def together() -> None:
        copy()
        compute()
    phases.update({"b/compute": phase(compute), "b/copy to host": phase(copy), "b/together": phase(together)})
    return phases


def run_overlap_bench(config: OverlapBenchConfig) -> dict[str, Any]:
    config = config.resolved()
    if config.device == "cuda":
        samples = run_interleaved(_cuda_phases(config), rounds=config.rounds, warmup_rounds=1)
        where = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    else:
        spec = LaunchSpec(plan=parse_devices("cpu:2", cuda_count=0), threads_per_device=1,
                          timeout_s=config.timeout_s, deadline_s=config.deadline_s)
        samples = launch(_cpu_worker, config, spec=spec)[0]  # phases end at a barrier: rank 0 speaks for both
        where = "2 CPU processes x 1 thread (gloo)"
    experiments = []
    for key, title in (("a", "two workloads on two devices"), ("b", "compute and communicate")):
        parts = [name for name in samples if name.startswith(f"{key}/") and name != f"{key}/together"]
        if not parts:
            continue
        sum_of_parts = [sum(values) for values in zip(*(samples[name] for name in parts))]
        experiments.append({
            "experiment": key, "title": title,
            "parts_s": {name.split("/", 1)[1]: Spread.of(samples[name]).to_dict() for name in parts},
            "sum_of_parts_s": Spread.of(sum_of_parts).to_dict(),
            "together_s": Spread.of(samples[f"{key}/together"]).to_dict(),
            "sum_of_parts_over_together": paired_ratio(sum_of_parts, samples[f"{key}/together"]).to_dict(),
        })
    return {"bench": "overlap", "config": asdict(config), "where": where, "experiments": experiments}


def report_overlap(payload: dict[str, Any]) -> str:
    config = payload["config"]
    lines = [f"on {payload['where']}: {config['matmuls']} matmuls of {config['matrix_size']}^2, "
             f"transfer {config['transfer_mb']:g} MB; ms, median (min-max) of {config['rounds']} interleaved rounds"]
    for exp in payload["experiments"]:
        rows = [(name, Spread.from_dict(s).scaled(1e3).fmt(1)) for name, s in exp["parts_s"].items()]
        rows += [("sum of parts", Spread.from_dict(exp["sum_of_parts_s"]).scaled(1e3).fmt(1)),
                 ("together", Spread.from_dict(exp["together_s"]).scaled(1e3).fmt(1)),
                 ("sum of parts / together", Spread.from_dict(exp["sum_of_parts_over_together"]).fmt(2))]
        lines += ["", f"({exp['experiment']}) {exp['title']}", format_table(["phase", "ms"], rows)]
    if not any(e["experiment"] == "a" for e in payload["experiments"]):
        lines += ["", "(a) skipped: it needs two devices"]
    return "\n".join(lines)


def plot_overlap(payload: dict[str, Any]):
    """Per experiment: the parts stacked (run one after another) next to the together bar."""
    experiments = payload["experiments"]
    fig, axes = new_figure(len(experiments), width_per_plot=4.0)
    for ax, exp in zip(axes, experiments):
        bottom = 0.0
        for name, spread in exp["parts_s"].items():
            ax.bar("sum of parts", spread["median"] * 1e3, bottom=bottom, label=name)
            bottom += spread["median"] * 1e3
        together = exp["together_s"]
        ax.bar("together", together["median"] * 1e3, color="tab:gray",
               yerr=[[(together["median"] - together["min"]) * 1e3], [(together["max"] - together["median"]) * 1e3]],
               capsize=4)
        ax.set_ylabel("ms")
        ax.set_title(f"({exp['experiment']}) {exp['title']}", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    return fig
