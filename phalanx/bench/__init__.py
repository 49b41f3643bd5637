"""`phalanx bench allreduce|scaling|memory|overlap|splits|autopar|hosts`: the measurements behind "phalanx beats
DDP", the "Automatic Parallelism" chapter's experiments (phalanx/autopar/: `overlap`, `autopar`), and
flat vs hierarchical allreduce on simulated hosts (`hosts`).

Each benchmark lives in its own module (allreduce.py, scaling.py, memory.py, splits.py; autopar/chapter.py,
autopar/exercises.py) with its config dataclass, its run, its terminal table and its chart; the
measuring kit (phalanx/measure/) holds the method they share (warm-up, calibration, interleaved
rounds in fresh processes, median and min-max, flag lists, the --out check, JSON and PNG
output). This module only maps flags onto those configs: `add_bench_parser(subparsers)` adds the
`bench` subcommand to the CLI's parser and `run_bench(args)` runs the chosen one, printing its
table and writing `<name>.json` and `<name>.png` into `--out` (default `runs/bench-<name>`).
"""

from __future__ import annotations

import argparse
import functools
import sys

from phalanx.comm.algorithms import ALGORITHMS
from phalanx.errors import UsageError

BENCHMARKS = ("allreduce", "scaling", "memory", "overlap", "splits", "autopar", "hosts")


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add `bench` with its subcommands to an argparse subparsers object; return it."""
    bench = subparsers.add_parser("bench", help="measure allreduce, scaling against DDP, sharded memory, overlap, "
                                  "splits; the automatic parallelism exercises")
    kinds = bench.add_subparsers(dest="bench_name", parser_class=type(bench))

    allreduce = kinds.add_parser("allreduce", help="time each allreduce algorithm, and reduce-scatter and all-gather, "
                                 "over sizes and world sizes")
    allreduce.add_argument("--sizes", default="4KB,64KB,512KB,1MB,16MB,64MB", help="message sizes (binary KB/MB)")
    allreduce.add_argument("--world-sizes", default="2,3,4", help="process counts, one spawned run each")
    allreduce.add_argument("--algorithms", default=",".join(ALGORITHMS), help=f"any of {', '.join(ALGORITHMS)}")
    allreduce.add_argument("--collectives", default="allreduce,reduce-scatter,all-gather",
                           help="any of allreduce, reduce-scatter, all-gather (the last two: native, shm, hierarchical, ring)")
    allreduce.add_argument("--rounds", type=int, default=5, help="interleaved timed rounds (default 5)")

    scaling = kinds.add_parser("scaling", help="images/s: phalanx on 1..k devices vs DDP, one process, ceiling")
    scaling.add_argument("--model", default="lenet", help="lenet or mlp (784-2048-2048-10, 5.8 M parameters)")
    scaling.add_argument("--batch-sizes", default="256,1024", help="global batch sizes")
    scaling.add_argument("--devices", type=int, default=2, help="k, the most CPU processes (default 2)")
    scaling.add_argument("--steps", type=int, default=6, help="timed steps per configuration (default 6)")
    scaling.add_argument("--warmup-steps", type=int, default=2, help="untimed steps first (default 2)")
    scaling.add_argument("--rounds", type=int, default=3, help="interleaved rounds, fresh processes each (default 3)")
    scaling.add_argument("--grad-dtype", default=None, help="also time phalanx/k exchanging bf16 or fp16 gradients")
    scaling.add_argument("--finite-check-cost", action="store_true",
                         help="also time phalanx/k with the gradient's NaN/Inf check off and at every step")

    memory = kinds.add_parser("memory", help="bytes per rank, peak RSS and step time: phalanx's ZeRO stages vs "
                              "DDP, ZeroRedundancyOptimizer, FSDP2")
    memory.add_argument("--models", default="lenet,mlp,mlp-wide,resnet",
                        help="any of lenet, mlp (5.8 M parameters), mlp-wide (53.6 M), resnet (default all)")
    memory.add_argument("--devices", type=int, default=2, help="k, the processes of every contender (default 2)")
    memory.add_argument("--batch-size", type=int, default=128, help="global batch (default 128)")
    memory.add_argument("--steps", type=int, default=5, help="timed steps per contender (default 5)")
    memory.add_argument("--warmup-steps", type=int, default=2, help="untimed steps first (default 2)")
    memory.add_argument("--rounds", type=int, default=3, help="interleaved rounds, fresh processes each (default 3)")
    memory.add_argument("--contenders", default="ddp,zero,fsdp2,none,optimizer,gradients,parameters",
                        help="any of ddp, zero (DDP + ZeroRedundancyOptimizer), fsdp2, and phalanx's none, "
                        "optimizer, gradients, parameters (default all)")

    overlap = kinds.add_parser("overlap", help="two devices at once; compute while communicating")
    overlap.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    overlap.add_argument("--matrix-size", type=int, default=None, help="matmul side (cpu 512, cuda 4096)")
    overlap.add_argument("--matmuls", type=int, default=None, help="matmuls per compute phase (cpu 16, cuda 10)")
    overlap.add_argument("--transfer-mb", type=float, default=None, help="allreduce / copy size (cpu 64, cuda 512)")
    overlap.add_argument("--algorithm", default="native", help="allreduce overlapped on CPU (default native)")
    overlap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")

    splits = kinds.add_parser("splits", help="data vs layers vs channels on LeNet: bytes, time, idle, memory")
    splits.add_argument("--devices", default="2,4", help="device counts k, one spawned run each (default 2,4)")
    splits.add_argument("--batch-size", type=int, default=256, help="global batch (default 256)")
    splits.add_argument("--micro-batches", type=int, default=None, help="layers: micro-batches (default 2k)")
    splits.add_argument("--schedule", default="gpipe", help="layers: gpipe or 1f1b (default gpipe)")
    splits.add_argument("--steps", type=int, default=5, help="timed steps per split per round (default 5)")
    splits.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    splits.add_argument("--dtype", default="float32", help="float32 or float64 (default float32)")

    autopar = kinds.add_parser("autopar", help="the Automatic Parallelism exercises: 1, 2, 3, 5 (and 4: --trace)")
    autopar.add_argument("--experiments", default="1,2,3,5", help="which of 1, 2, 3, 5 (default all)")
    autopar.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    autopar.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    autopar.add_argument("--trace", default=None, metavar="DIR",
                         help="experiment 4: a profiler trace (Chrome JSON + PNG timeline) of each experiment")
    autopar.add_argument("--lanes", type=int, default=None, help="CPU threads (default: cores) or CUDA streams (4)")
    autopar.add_argument("--matrix-size", type=int, default=None, help="1: product side (cpu 512, cuda 4096)")
    autopar.add_argument("--matmuls", type=int, default=None, help="1: independent products (default 8)")
    autopar.add_argument("--sizes", default="32,64,128,256,512,1024,2048", help="2: product sides swept")
    autopar.add_argument("--ops-per-size", type=int, default=None, help="2: products per size (default 2 per lane)")
    autopar.add_argument("--target-ms", type=float, default=30.0, help="1, 2: ms of all products on one core per sample (default 30)")
    autopar.add_argument("--chunks", type=int, default=16, help="3: chunks through the pipeline (default 16)")
    autopar.add_argument("--chunk-rows", type=int, default=None, help="3: rows per chunk (cpu 8192)")
    autopar.add_argument("--width", type=int, default=None, help="3: columns per chunk (cpu 64)")
    autopar.add_argument("--batch-size", type=int, default=None, help="5: global batch, even (cpu 1024)")
    autopar.add_argument("--hidden", type=int, default=None, help="5: hidden units (cpu 1024)")
    autopar.add_argument("--steps", type=int, default=3, help="5: SGD steps in the graph (default 3)")
    autopar.add_argument("--dtype", default="float32", help="float32 or float64 (default float32)")

    from phalanx.bench.hosts import HostsBenchConfig
    from phalanx.options import add_options

    hosts = kinds.add_parser("hosts", help=HostsBenchConfig.__doc__.strip())
    add_options(hosts, HostsBenchConfig)

    for parser in (allreduce, scaling, memory, overlap, splits, autopar, hosts):
        parser.add_argument("--out", default=None, help="directory for the JSON and PNG (default runs/bench-NAME)")
    return bench


def _progress(message: str) -> None:
    print(f"phalanx bench: {message}", file=sys.stderr, flush=True)


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark `args` names: table to stdout, JSON + PNG into --out. Returns 0."""
    name = getattr(args, "bench_name", None)
    if name not in BENCHMARKS:
        raise UsageError(f"choose a benchmark: phalanx bench {'|'.join(BENCHMARKS)}")
    # Imported here so the CLI's parser does not load matplotlib or the benchmarks.
    from phalanx.autopar import chapter as overlap
    from phalanx.bench import allreduce, memory, memory_report, scaling, scaling_report, splits, splits_report
    from phalanx.measure.flags import parse_list, parse_size
    from phalanx.measure.outputs import prepare_out_dir, write_outputs

    if name == "autopar":
        return _run_autopar(args)
    try:
        if name == "hosts":
            from phalanx.bench import hosts
            from phalanx.options import build

            config = hosts.require_bed(build(hosts.HostsBenchConfig, args))
            run, report, plot = hosts.run_hosts_bench, hosts.report_hosts, hosts.plot_hosts
        elif name == "allreduce":
            config = allreduce.AllreduceBenchConfig(
                sizes_bytes=parse_list(args.sizes, parse_size, flag="--sizes"),
                world_sizes=parse_list(args.world_sizes, int, flag="--world-sizes"),
                algorithms=parse_list(args.algorithms, str, flag="--algorithms"),
                collectives=parse_list(args.collectives, str, flag="--collectives"), rounds=args.rounds)
            run, report, plot = allreduce.run_allreduce_bench, allreduce.report_allreduce, allreduce.plot_allreduce
        elif name == "scaling":
            config = scaling.ScalingBenchConfig(
                model=args.model, global_batch_sizes=parse_list(args.batch_sizes, int, flag="--batch-sizes"),
                num_devices=args.devices, steps=args.steps, warmup_steps=args.warmup_steps, rounds=args.rounds,
                grad_dtype=args.grad_dtype, finite_check_cost=args.finite_check_cost)
            run = functools.partial(scaling.run_scaling_bench, on_run=_progress)
            report, plot = scaling_report.report_scaling, scaling_report.plot_scaling
        elif name == "memory":
            config = memory.MemoryBenchConfig(
                models=parse_list(args.models, str, flag="--models"), num_devices=args.devices,
                global_batch_size=args.batch_size, steps=args.steps, warmup_steps=args.warmup_steps,
                rounds=args.rounds, contenders=parse_list(args.contenders, str, flag="--contenders"))
            run = functools.partial(memory.run_memory_bench, on_run=_progress)
            report, plot = memory_report.report_memory, memory_report.plot_memory
        elif name == "splits":
            config = splits.SplitsBenchConfig(
                world_sizes=parse_list(args.devices, int, flag="--devices"), global_batch_size=args.batch_size,
                micro_batches=args.micro_batches, schedule=args.schedule, steps=args.steps, rounds=args.rounds,
                dtype=args.dtype)
            run = functools.partial(splits.run_splits_bench, on_run=_progress)
            report, plot = splits_report.report_splits, splits_report.plot_splits
        else:
            config = overlap.OverlapBenchConfig(
                device=args.device, matrix_size=args.matrix_size, matmuls=args.matmuls,
                transfer_mb=args.transfer_mb, algorithm=args.algorithm, rounds=args.rounds).resolved()
            run, report, plot = overlap.run_overlap_bench, overlap.report_overlap, overlap.plot_overlap
    except ValueError as exc:  # a config names the offending numbers: the user's to fix
        raise UsageError(str(exc)) from None
    out_dir = prepare_out_dir(args.out or f"runs/bench-{name}")
    _progress(f"{name}: measuring (warm-up first, then {config.rounds} interleaved rounds)")
    payload = run(config)
    print(report(payload), flush=True)
    json_path, png_path = write_outputs(out_dir, name, payload, plot(payload))
    print(f"\nwrote {json_path} and {png_path}")
    return 0


def _run_autopar(args: argparse.Namespace) -> int:
    """Like the others, and 1 (after writing everything) when a correctness check failed."""
    from phalanx.autopar import exercises as autopar
    from phalanx.autopar import report as autopar_report
    from phalanx.measure.flags import parse_list
    from phalanx.measure.outputs import prepare_out_dir, write_outputs
    from phalanx.outdir import check_out_dir

    try:
        config = autopar.AutoparBenchConfig(
            experiments=parse_list(args.experiments, int, flag="--experiments"), device=args.device,
            rounds=args.rounds, trace_dir=args.trace, lanes=args.lanes, matrix_size=args.matrix_size,
            matmuls=args.matmuls, sizes=parse_list(args.sizes, int, flag="--sizes"), ops_per_size=args.ops_per_size,
            target_ms=args.target_ms, chunks=args.chunks, chunk_rows=args.chunk_rows, width=args.width,
            batch_size=args.batch_size, hidden=args.hidden, steps=args.steps, dtype=args.dtype).resolved()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    check_out_dir(args.trace, flag="--trace")
    out_dir = prepare_out_dir(args.out or "runs/bench-autopar")
    _progress(f"autopar: experiments {','.join(map(str, config.experiments))} on {config.device} "
              f"(warm-up first, then {config.rounds} interleaved rounds)")
    payload = autopar.run_autopar_bench(config, on_progress=lambda message: _progress(f"autopar: {message}"))
    print(autopar_report.report_autopar(payload), flush=True)
    json_path, png_path = write_outputs(out_dir, "autopar", payload, autopar_report.plot_autopar(payload))
    print(f"\nwrote {json_path} and {png_path} ({payload['elapsed_s']:.0f} s)")
    failed = [str(e["experiment"]) for e in payload["experiments"] if not e["check"]["passed"]]
    if failed:
        _progress(f"autopar: the correctness check of experiment {', '.join(failed)} FAILED; see the table")
        return 1
    return 0


__all__ = ["BENCHMARKS", "add_bench_parser", "run_bench"]
