"""`phalanx bench KIND`: the table of benchmarks, their generated parsers, and the one way each runs.

`BENCHMARKS` names each kind and what it is made of: its config class (every flag, default, help
and check declared once, on the fields; the docstring's first line is the kind's summary), the
measurement (config -> JSON payload), the terminal table and the chart (payload -> text, figure).
A new benchmark is one config class beside its code and one entry here. `add_bench_arguments`
gives `bench` one subcommand per entry, its flags generated from the config (phalanx/options.py)
plus `--out`; `run_bench` builds the config, checks what can be checked before anything is
written, measures, prints the table and writes `<kind>.json` and `<kind>.png` into `--out`
(default `runs/bench-<kind>`).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from phalanx.autopar.chapter import OverlapBenchConfig, plot_overlap, report_overlap, run_overlap_bench
from phalanx.autopar.exercises import AutoparBenchConfig, run_autopar_bench
from phalanx.autopar.report import plot_autopar, report_autopar
from phalanx.bench.allreduce import AllreduceBenchConfig, plot_allreduce, report_allreduce, run_allreduce_bench
from phalanx.bench.hosts import HostsBenchConfig, plot_hosts, report_hosts, require_bed, run_hosts_bench
from phalanx.bench.memory import MemoryBenchConfig, run_memory_bench
from phalanx.bench.memory_report import plot_memory, report_memory
from phalanx.bench.scaling import ScalingBenchConfig, run_scaling_bench
from phalanx.bench.scaling_report import plot_scaling, report_scaling
from phalanx.bench.gpu import GpuBenchConfig, gpu_failed, run_gpu_bench
from phalanx.bench.gpu_report import plot_gpu, report_gpu
from phalanx.bench.splits import SplitsBenchConfig, run_splits_bench
from phalanx.bench.splits_report import plot_splits, report_splits
from phalanx.bench.step import StepBenchConfig, plot_step, report_step, run_step_bench
from phalanx.errors import UsageError
from phalanx.measure.outputs import prepare_out_dir, write_outputs
from phalanx.options import add_options, build, option
from phalanx.outdir import check_out_dir


def _progress(message: str) -> None:
    print(f"phalanx bench: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True, kw_only=True)
class Benchmark:
    """One kind of `phalanx bench`: what it is asked (`config`), how it measures, how it is shown."""

    config: type  # a kw_only dataclass of option() fields; its docstring's first line is the summary
    run: Callable[[Any], dict[str, Any]]  # config -> JSON payload
    report: Callable[[dict[str, Any]], str]  # payload -> the terminal table
    plot: Callable[[dict[str, Any]], Any]  # payload -> a matplotlib figure
    # Before anything is written: the config to run, with derived defaults filled in and paths
    # checked (a ValueError or UsageError here is one line, and --out stays unmade).
    prepare: Callable[[Any], Any] = lambda config: config
    # After everything is written: why the run failed its own correctness check (exit 1), or None.
    failed: Callable[[dict[str, Any]], str | None] = lambda payload: None

    @property
    def summary(self) -> str:
        return (self.config.__doc__ or "").strip().splitlines()[0]


def _prepare_autopar(config: AutoparBenchConfig) -> AutoparBenchConfig:
    check_out_dir(config.trace_dir, flag="--trace")
    return config.resolved()


def _autopar_failed(payload: dict[str, Any]) -> str | None:
    failed = [str(e["experiment"]) for e in payload["experiments"] if not e["check"]["passed"]]
    return f"autopar: the correctness check of experiment {', '.join(failed)} FAILED; see the table" if failed else None


BENCHMARKS: dict[str, Benchmark] = {
    "allreduce": Benchmark(config=AllreduceBenchConfig, run=run_allreduce_bench, report=report_allreduce,
                           plot=plot_allreduce),
    "scaling": Benchmark(config=ScalingBenchConfig, run=functools.partial(run_scaling_bench, on_run=_progress),
                         report=report_scaling, plot=plot_scaling),
    "memory": Benchmark(config=MemoryBenchConfig, run=functools.partial(run_memory_bench, on_run=_progress),
                        report=report_memory, plot=plot_memory),
    "overlap": Benchmark(config=OverlapBenchConfig, run=run_overlap_bench, report=report_overlap, plot=plot_overlap,
                         prepare=OverlapBenchConfig.resolved),
    "splits": Benchmark(config=SplitsBenchConfig, run=functools.partial(run_splits_bench, on_run=_progress),
                        report=report_splits, plot=plot_splits),
    "autopar": Benchmark(config=AutoparBenchConfig,
                         run=functools.partial(run_autopar_bench, on_progress=lambda m: _progress(f"autopar: {m}")),
                         report=report_autopar, plot=plot_autopar, prepare=_prepare_autopar, failed=_autopar_failed),
    "step": Benchmark(config=StepBenchConfig, run=functools.partial(run_step_bench, on_run=_progress),
                      report=report_step, plot=plot_step, prepare=StepBenchConfig.prepare),
    "gpu": Benchmark(config=GpuBenchConfig, run=functools.partial(run_gpu_bench, on_run=_progress), report=report_gpu,
                     plot=plot_gpu, prepare=GpuBenchConfig.prepare, failed=gpu_failed),
    "hosts": Benchmark(config=HostsBenchConfig, run=run_hosts_bench, report=report_hosts, plot=plot_hosts,
                       prepare=require_bed),
}


@dataclass(frozen=True, kw_only=True)
class BenchOutput:
    """output"""

    out_dir: str | None = option(None, flag="--out", metavar="DIR", default_text="runs/bench-NAME",
                                 help="directory for the JSON and PNG")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """`bench`'s parser: one subcommand per benchmark, its flags generated from its config, and --out."""
    kinds = parser.add_subparsers(dest="bench_name", parser_class=type(parser))
    for name, benchmark in BENCHMARKS.items():
        kind = kinds.add_parser(name, help=benchmark.summary, description=benchmark.summary)
        add_options(kind, benchmark.config)
        add_options(kind, BenchOutput)


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark `args` names: table to stdout, JSON + PNG into --out. 0, or 1 when the
    benchmark's own correctness check failed (after writing everything)."""
    name = getattr(args, "bench_name", None)
    if name not in BENCHMARKS:
        raise UsageError(f"choose a benchmark: phalanx bench {'|'.join(BENCHMARKS)}")
    benchmark = BENCHMARKS[name]
    config = build(benchmark.config, args)
    try:
        config = benchmark.prepare(config)
    except ValueError as exc:  # a config names the offending numbers: the user's to fix
        raise UsageError(str(exc)) from None
    out_dir = prepare_out_dir(build(BenchOutput, args).out_dir or f"runs/bench-{name}")
    _progress(f"{name}: measuring (warm-up first, then {config.rounds} interleaved rounds)")
    start_s = time.perf_counter()
    payload = benchmark.run(config)
    print(benchmark.report(payload), flush=True)
    json_path, png_path = write_outputs(out_dir, name, payload, benchmark.plot(payload))
    print(f"\nwrote {json_path} and {png_path} ({time.perf_counter() - start_s:.0f} s)")
    failed = benchmark.failed(payload)
    if failed is not None:
        _progress(failed)
        return 1
    return 0


__all__ = ["BENCHMARKS", "Benchmark", "BenchOutput", "add_bench_arguments", "run_bench"]
