"""`phalanx bench autopar`: the five exercises of D2L's "Automatic Parallelism" as experiments.

`bench overlap` runs the chapter's own two experiments; this runs its exercises, each warmed
up, timed over interleaved rounds and reduced to the same outcome (autopar_report.py): measured,
in sequence, ideal, speed-up, share of the ideal, a verdict and a correctness check.

1. independent products: does PyTorch run them at once by itself; what explicit concurrency
   buys (CPU: lane threads with one intra-op thread each; CUDA: streams)      autopar_ops.py
2. small operators: the same over sizes, and the crossover below which concurrency wins
3. computation + communication + computation at once: a three-stage pipeline over chunks
   (CUDA: GPU, copy engine, CPU; CPU: the labelled two-process analogue)   autopar_pipeline.py
4. a profiler trace of every experiment (`trace_dir`)                         autopar_trace.py
5. the chapter's two-layer MLP over two devices and the host as a task graph, run by a
   dependency-driven scheduler against strictly in sequence                  autopar_deps.py
The CUDA variants are in autopar_cuda.py. This module holds the config and puts them together.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

import torch

from phalanx.autopar import report
from phalanx.autopar.trace import every_thread
from phalanx.measure.load import cpu_taken_by_others
from phalanx.measure.timing import Spread, device_and_sizes, paired_ratio, per_device
from phalanx.options import Rule, at_least, check_options, finite, option, positive
from phalanx.runtime.binding import available_cores

EXPERIMENTS = (1, 2, 3, 5)
DEFAULT_SIZES = (32, 64, 128, 256, 512, 1024, 2048)
# Sizes for a 2-core CPU: every sample tens of ms, the whole run well under 3 minutes. GPU:
# D2L's 4096^2 products; a pipeline chunk of ~1 ms on an H100-class GPU (estimates, not run here).
_DEFAULTS = {
    "cpu": {"matrix_size": 512, "matmuls": 8, "chunk_rows": 8192, "width": 64, "batch_size": 1024, "hidden": 1024},
    "cuda": {"matrix_size": 4096, "matmuls": 8, "chunk_rows": 16384, "width": 256, "batch_size": 8192,
             "hidden": 4096},
}


@dataclass(frozen=True, kw_only=True)
class AutoparBenchConfig:
    """the Automatic Parallelism exercises: 1, 2, 3, 5 (and 4: --trace)"""

    # 4 is the profiler, asked for with --trace: checked below, with that hint.
    experiments: tuple[int, ...] = option(EXPERIMENTS, items=int, help="which of 1, 2, 3, 5")
    device: str = option("auto", choices=("auto", "cpu", "cuda"), help="auto: cuda when torch sees a GPU, else cpu")
    rounds: int = option(5, check=at_least(1), help="interleaved rounds")
    # None: filled in by `resolved` (CPU: the cores, at least 2; CUDA: 4), as are the sizes below.
    lanes: int | None = option(None, default_text="cpu: the cores (at least 2), cuda: 4",
                               check=at_least(2, problem="must be at least 2 (one lane has nothing to run beside it)"),
                               help="concurrent lanes: CPU threads or CUDA streams")
    matrix_size: int | None = option(None, default_text=per_device(_DEFAULTS, "matrix_size"), check=at_least(1),
                                     help="1: product side")
    matmuls: int | None = option(None, default_text=per_device(_DEFAULTS, "matmuls"), check=at_least(1),
                                 help="1: independent products")
    sizes: tuple[int, ...] = option(DEFAULT_SIZES, items=int, check=at_least(1), help="2: product sides swept")
    ops_per_size: int | None = option(None, default_text="2 per lane", check=at_least(1), help="2: products per size")
    target_ms: float = option(30.0, check=finite(positive("number of milliseconds")),
                              help="1, 2: ms of all products on one core per sample")
    chunks: int = option(16, check=at_least(1), help="3: chunks through the pipeline")
    chunk_rows: int | None = option(None, default_text=per_device(_DEFAULTS, "chunk_rows"), check=at_least(1),
                                    help="3: rows per chunk")
    width: int | None = option(None, default_text=per_device(_DEFAULTS, "width"), check=at_least(1),
                               help="3: columns per chunk")
    batch_size: int | None = option(None, default_text=per_device(_DEFAULTS, "batch_size"),
                                    check=Rule(ok=lambda b: b >= 2 and b % 2 == 0,
                                               problem="must be even and at least 2 (a half per device)"),
                                    help="5: global batch, half per device")
    in_features: int = 784
    hidden: int | None = option(None, default_text=per_device(_DEFAULTS, "hidden"), check=at_least(1),
                                help="5: hidden units")
    out_features: int = 128
    steps: int = option(3, check=at_least(1), help="5: SGD steps unrolled into one graph")
    dtype: str = option("float32", choices=("float32", "float64"), help="the products' and the MLP's dtype")
    trace_dir: str | None = option(None, flag="--trace", metavar="DIR", default_text="no trace",
                                   help="experiment 4: a profiler trace (Chrome JSON + PNG timeline) of each experiment")
    timeout_s: float = 60.0
    deadline_s: float = 300.0

    def __post_init__(self) -> None:
        check_options(self)
        if 4 in self.experiments:
            raise ValueError("experiment 4 is the profiler: add --trace DIR to trace experiments 1, 2, 3 and 5")
        if self.trace_dir is not None:
            every_thread()  # before any experiment runs: an older torch's profiler cannot trace the lanes
        unknown = sorted(set(self.experiments) - set(EXPERIMENTS))
        if unknown or len(set(self.experiments)) != len(self.experiments):
            raise ValueError(f"--experiments {_csv(self.experiments)}: choose distinct ones of 1, 2, 3, 5")
        if list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError(f"--sizes {_csv(self.sizes)} must be distinct positive numbers in ascending order")
        for name in ("in_features", "out_features"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)} must be at least 1")

    def resolved(self) -> "AutoparBenchConfig":
        """Device picked, lanes and every size filled in."""
        device, sizes = device_and_sizes(self, _DEFAULTS)
        lanes = self.lanes or (4 if device == "cuda" else max(2, available_cores()))
        return replace(self, device=device, lanes=lanes, ops_per_size=self.ops_per_size or 2 * lanes, **sizes)


def _csv(values) -> str:
    return ",".join(map(str, values))


def _independent(config: AutoparBenchConfig, *, size: int, count: int, each_alone: bool, trace: str | None):
    if config.device == "cuda":
        from phalanx.autopar import cuda as autopar_cuda

        return autopar_cuda.measure_streams(size=size, count=count, streams=config.lanes, rounds=config.rounds,
                                            target_s=config.target_ms / 1e3, dtype=config.dtype,
                                            each_alone=each_alone, trace=trace and (config.trace_dir, trace))
    from phalanx.autopar import ops as autopar_ops

    return autopar_ops.measure_cpu(size=size, count=count, cores=available_cores(), lanes=config.lanes,
                                   rounds=config.rounds, target_s=config.target_ms / 1e3, dtype=config.dtype,
                                   each_alone=each_alone, deadline_s=config.deadline_s,
                                   trace=trace and (config.trace_dir, trace))


def _how_concurrent(config: AutoparBenchConfig) -> str:
    if config.device == "cuda":
        return f"{config.lanes} CUDA streams vs one"
    return f"{config.lanes} threads x 1 intra-op thread vs eager with {available_cores()} intra-op threads"


def experiment_1(config: AutoparBenchConfig) -> dict[str, Any]:
    m = _independent(config, size=config.matrix_size, count=config.matmuls, each_alone=True,
                     trace="exp1" if config.trace_dir else None)
    s = m["samples"]
    result = report.outcome(measured_s=s["concurrent"], sequential_s=s["eager"], ideal_s=_ideal(s))
    eager_over_alone = paired_ratio(s["eager"], s["each alone, summed"])
    return {"experiment": 1, "title": f"{config.matmuls} independent {config.matrix_size}^2 products",
            "how": _how_concurrent(config), "outcome": result, "check": m["check"], "repeats": m["repeats"],
            "contenders_s": {name: Spread.of(v).to_dict() for name, v in s.items()},
            "eager_over_each_alone": eager_over_alone.to_dict(),
            "verdict": report.verdict_independent(result, eager_over_alone=eager_over_alone.median,
                                                  how="explicitly concurrent", asynchronous=config.device == "cuda",
                                                  device_bound_s=_device_bound_s(s))}


def _longest_share(samples: dict[str, list[float]]) -> list[float]:
    shares = [v for name, v in samples.items() if name.startswith("share ") and name.endswith(" alone")]
    return [max(values) for values in zip(*shares)]


def _ideal(samples: dict[str, list[float]]) -> list[float]:
    """Per round: the longest share alone (each lane its own processor), and on a GPU no less than
    all the products as one batched kernel (the lanes share one device: its own bound)."""
    longest = _longest_share(samples)
    return [max(a, b) for a, b in zip(longest, samples["batched"])] if "batched" in samples else longest


def _device_bound_s(samples: dict[str, list[float]]) -> float | None:
    """The batched kernel's median time where it, not the lanes, bounds the ideal; else None."""
    if "batched" not in samples:
        return None
    device = Spread.of(samples["batched"]).median
    return device if device >= Spread.of(_longest_share(samples)).median else None


def experiment_2(config: AutoparBenchConfig, *, on_size: Callable[[str], None] | None = None) -> dict[str, Any]:
    sweep = []
    for size in config.sizes:
        if on_size is not None:
            on_size(f"experiment 2: n={size}")
        m = _independent(config, size=size, count=config.ops_per_size, each_alone=False,
                         trace=f"exp2-n{size}" if config.trace_dir else None)
        s = m["samples"]
        sweep.append({"size": size, "repeats": m["repeats"], "check": m["check"],
                      "contenders_s": {name: Spread.of(v).to_dict() for name, v in s.items()},
                      "outcome": report.outcome(measured_s=s["concurrent"], sequential_s=s["eager"],
                                                ideal_s=_ideal(s))})
    speedups = [r["outcome"]["speedup"]["median"] for r in sweep]
    cross = report.crossover(list(config.sizes), speedups)
    passed = all(r["check"]["passed"] for r in sweep)
    return {"experiment": 2, "title": f"{config.ops_per_size} small products per size",
            "how": _how_concurrent(config), "sweep": sweep, "crossover": cross,
            "check": {"passed": passed, "bitwise": True, "what": f"{sweep[0]['check']['what']}, at every size"},
            "verdict": report.verdict_sweep(cross, list(config.sizes), speedups, "concurrency")}


def experiment_3(config: AutoparBenchConfig) -> dict[str, Any]:
    if config.device == "cuda":
        from phalanx.autopar import cuda as autopar_cuda

        m = autopar_cuda.measure_pipeline(chunks=config.chunks, chunk_rows=config.chunk_rows, width=config.width,
                                          rounds=config.rounds, dtype=config.dtype, trace_dir=config.trace_dir)
        how, title, cores = "GPU computes, copy engine moves, CPU reduces", "GPU + copy + CPU pipeline", None
    else:
        from phalanx.autopar.pipeline import PipelineJob, run_cpu_pipeline

        job = PipelineJob(chunks=config.chunks, chunk_rows=config.chunk_rows, width=config.width,
                          rounds=config.rounds, dtype=config.dtype, trace_dir=config.trace_dir)
        m = run_cpu_pipeline(job, timeout_s=config.timeout_s, deadline_s=config.deadline_s)
        how = "CPU analogue: 2 processes x 1 thread, gloo isend/irecv"
        title, cores = "compute | transfer | reduce pipeline", available_cores()
    result = report.outcome(measured_s=m["measured_s"], sequential_s=m["sequential_s"], ideal_s=m["ideal_s"])
    stages = {name: Spread.of(v).median for name, v in m["stages_s"].items()}
    extra = {"in sequence, wall (with handshakes)": Spread.of(m["sequential_wall_s"]).to_dict()}
    return {"experiment": 3, "title": title, "how": how, "outcome": result, "check": m["check"],
            "stages_s": {name: Spread.of(v).to_dict() for name, v in m["stages_s"].items()}, "references_s": extra,
            "verdict": report.verdict_pipeline(result, stages_s=stages, chunks=config.chunks, cores=cores)}


def experiment_5(config: AutoparBenchConfig) -> dict[str, Any]:
    sizes = dict(batch_size=config.batch_size, in_features=config.in_features, hidden=config.hidden,
                 out_features=config.out_features, steps=config.steps, rounds=config.rounds, dtype=config.dtype,
                 trace_dir=config.trace_dir)
    if config.device == "cuda":
        from phalanx.autopar import cuda_graph as autopar_cuda_graph

        m = autopar_cuda_graph.measure_cuda_mlp(**sizes, deadline_s=config.deadline_s)
        how = "2 CUDA streams (or GPUs) + host, events between them"
    else:
        from phalanx.autopar.deps import measure_cpu_mlp

        m = measure_cpu_mlp(**sizes, cores=available_cores(), deadline_s=config.deadline_s)
        how = "threads: 2 device lanes + host, 1 intra-op thread each"
    s = m["samples"]
    result = report.outcome(measured_s=s["scheduled"], sequential_s=s["in sequence"],
                            ideal_s=[r["ideal_s"] for r in m["rounds"]])
    references = {name: Spread.of(v).to_dict() for name, v in s.items() if name not in ("scheduled", "in sequence")}
    all_cores = Spread.of(s["in sequence, all cores"]).median if "in sequence, all cores" in s else None
    return {"experiment": 5, "title": f"2-layer MLP, {config.steps} steps, 2 devices + host", "how": how,
            "outcome": result, "check": m["check"], "rounds": m["rounds"], "references_s": references,
            "tasks": m["tasks"], "edges": m["edges"],
            "verdict": report.verdict_graph(result, rounds=m["rounds"], tasks=m["tasks"], all_cores_s=all_cores,
                                            edges=m["edges"], check_passed=m["check"]["passed"])}


def where(config: AutoparBenchConfig) -> str:
    if config.device == "cuda":
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"CPU, {available_cores()} cores, torch {torch.__version__}"


def run_autopar_bench(config: AutoparBenchConfig, *,
                      on_progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the chosen experiments in order; the payload the table, JSON and PNG are made from."""
    config = config.resolved()
    say = on_progress or (lambda message: None)
    start_s = time.perf_counter()
    experiments = []
    for number in config.experiments:
        say(f"experiment {number}")
        others: dict[str, float | None] = {}
        with cpu_taken_by_others(others):
            if number == 2:
                experiment = experiment_2(config, on_size=say)
            else:
                experiment = {1: experiment_1, 3: experiment_3, 5: experiment_5}[number](config)
        # On a shared machine other processes decide how much of the cores a contender got: say it.
        experiments.append({**experiment, "others_cores": others["others_cores"]})
    return {"bench": "autopar", "config": asdict(config), "where": where(config), "trace_dir": config.trace_dir,
            "experiments": experiments, "checks_passed": all(e["check"]["passed"] for e in experiments),
            "elapsed_s": time.perf_counter() - start_s}
