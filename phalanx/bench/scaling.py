"""`phalanx bench scaling`: training throughput of phalanx against what a user would run instead.

Contenders, on synthetic data held in memory (one fixed random batch, so data time is zero for
all): phalanx on each device count `--devices` lists and on 1 (DataParallel + train_batch,
started by `phalanx.runtime.launch`: its allocator setting and cores/k threads, its default
allreduce - shm on one host), k being the largest count listed; phalanx on k
devices exchanging over gloo instead (what the shared-memory transport buys); phalanx on k
devices with each worker bound to its own cores (`--bind-cores`, when k <= cores); torch DDP
on k processes as a DDP user gets it (plain `DistributedDataParallel`, gloo, default buckets, 1
thread each, no allocator setting); one plain PyTorch process with 1 thread and with every core;
and the ceiling, k processes set up as phalanx's that train their shards with no communication
at all, and the same ceiling in lockstep, its ranks meeting at every step through a 4-byte
allreduce (phalanx ÷ lockstep ceiling is what the exchange costs; lockstep ÷ ceiling what waiting
for the slowest rank at every step costs on this host, which no exchange can avoid); with
`--finite-check-cost`, phalanx on k devices with the gradient's NaN/Inf check
(data_parallel/guards/finite.py; every 100 steps by default) off and at every step. How each contender
runs and is timed is the measuring kit's (phalanx/measure/step.py: fresh processes, warm-up
steps, a barrier, timed steps, the slowest rank's time); this module chooses the contenders,
interleaves them round by round, prints each contender's images/s and wall time as it completes,
and forms the ratios, each the median of per-round ratios. Scaling efficiency is images/s on j
devices / (j x images/s on 1); the speed-up, images/s on j / images/s on 1.

With `--side-by-side` only the contenders that share phalanx's set-up run - phalanx/k, ceiling/k,
the lockstep ceiling and DDP tuned in one start of k workers (and, where each has two threads or
more, phalanx/k with one fewer: a core per worker left); phalanx/1 and the tuned plain loop
in one start of one process, phalanx/j alone in a start of j workers for every other count of
`--devices` - each start's contenders taking turns in `--blocks` blocks of
`--steps` steps, the order rotated each block (phalanx/measure/side_by_side.py; the rounds:
scaling_side.py); a round is one start of each, and every ratio is the median of per-block
ratios: both sides ran seconds apart on the same cores, where fresh starts of one program differ
by 10-25% on a shared host. Side by side also says where each contender's step went (forward,
backward, wait, optimizer: the JSON's "phases"), so phalanx/k below its lockstep twin is split
phase by phase.

A round costs one fresh start of every contender, which runs every batch size in turn: with n
device counts (1 included) n + 9 starts (n + 8 where k exceeds the cores: no bound run). Each
start pays process spawn, `import torch` and a rendezvous before its warm-up and timed steps;
every start's wall time is in the JSON (`wall_s`, the same for each of its batch sizes), so a
round on a bigger host can be budgeted from it (docs/benchmarks.md).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Callable

from phalanx.bench.scaling_side import side_by_side_rounds
from phalanx.data_parallel import GRAD_DTYPES, DataParallelConfig
from phalanx.measure.mlp import BENCH_MODELS
from phalanx.measure.job_steps import StepJob
from phalanx.measure.step import Variant, images_per_s, run_jobs
from phalanx.measure.timing import Spread, paired_ratio, run_interleaved
from phalanx.measure.load import cpu_taken_by_others
from phalanx.options import at_least, device_count, check_options, option
from phalanx.runtime.binding import available_cores


# --finite-check-cost's contenders beside phalanx/k (DataParallel's default: a check every 100 steps).
FINITE_CHECKS = {"no finite check": 0, "finite check every step": 1}


@dataclass(frozen=True, kw_only=True)
class ScalingBenchConfig:
    """images/s: phalanx on 1..k devices vs DDP, one process, ceiling"""

    model: str = option("lenet", choices=BENCH_MODELS, help="the model (mlp: 784-2048-2048-10, 5.8 M parameters)")
    global_batch_sizes: tuple[int, ...] = option((256, 1024), flag="--batch-sizes", items=int, help="global batch sizes")
    device_counts: tuple[int, ...] = option((2,), flag="--devices", items=device_count, check=at_least(1),
                                            help="the device counts phalanx runs on, e.g. 1,2,4,8 (1 always runs: "
                                                 "the yardstick of scaling efficiency); every other contender runs "
                                                 "on the largest, k")
    warmup_steps: int = option(2, check=at_least(0), help="untimed steps first")
    steps: int = option(6, check=at_least(1), help="timed steps per configuration")
    rounds: int = option(3, check=at_least(1), help="interleaved rounds, fresh processes each")
    lr: float = 0.2  # the book's SGD lr, as `phalanx train`'s; the update's size does not change its cost
    seed: int = 0
    timeout_s: float = 120.0  # bound on one collective
    deadline_s: float = 600.0  # bound on one configuration's processes
    grad_dtype: str | None = option(None, choices=tuple(GRAD_DTYPES), default_text="not timed",
                                    help="also time phalanx/k exchanging gradients compressed to this dtype")
    finite_check_cost: bool = option(False, help="also time phalanx/k with the gradient's NaN/Inf check off and "
                                                 "at every step")
    side_by_side: bool = option(False, help="time only the contenders with phalanx's set-up, inside one start "
                                            "per device count, taking turns in blocks")
    blocks: int = option(10, check=at_least(1), help="with --side-by-side: blocks of --steps steps per contender "
                                                     "in each start (a round)")

    def __post_init__(self) -> None:
        check_options(self)
        if self.num_devices < 2:
            raise ValueError(f"--devices {','.join(map(str, self.device_counts))}: the largest count must be at "
                             "least 2 to compare scaling")
        if self.side_by_side:
            if self.grad_dtype is not None or self.finite_check_cost:
                raise ValueError("--side-by-side times the contenders with phalanx's set-up only; run --grad-dtype "
                                 "and --finite-check-cost without it")
        small = [b for b in self.global_batch_sizes if b < self.num_devices]
        if small:
            raise ValueError(f"--batch-sizes {','.join(map(str, self.global_batch_sizes))}: every global batch size "
                             f"must be at least --devices {self.num_devices} (one example per device)")

    @property
    def num_devices(self) -> int:
        """k: the largest device count, where every contender but phalanx/j runs."""
        return max(self.device_counts)

    @property
    def phalanx_counts(self) -> tuple[int, ...]:
        """The device counts phalanx runs on: those listed, and 1."""
        return tuple(sorted({1, *self.device_counts}))


def variants(device_counts: tuple[int, ...], cores: int, *, grad_dtype: str | None = None,
             finite_check_cost: bool = False, core_left: bool = False) -> list[Variant]:
    """The contenders: phalanx on each of `device_counts` (and 1), the others on k, the largest.
    "tuned" ones get phalanx's CPU set-up (allocator env, memory format), so the table separates
    what phalanx's defaults buy from what its engine does. `core_left` (--side-by-side): phalanx/k
    with a thread fewer each too, where its workers have two or more."""
    counts = sorted({1, *device_counts})
    k = counts[-1]
    per_proc = max(1, cores // k)
    phalanx = [Variant(name=f"phalanx/{j}", kind="phalanx", num_procs=j, threads_per_proc=max(1, cores // j),
                       allocator_env=True, memory_format="auto") for j in counts]
    at_k = phalanx[-1]
    phalanx.append(replace(at_k, name=f"phalanx/{k} gloo", algorithm="native"))
    phalanx.append(replace(at_k, name=f"phalanx/{k} overlapped", overlap=True))  # what auto turns off on full cores
    if k <= cores:  # --bind-cores: where the workers run, priced beside the default
        phalanx.append(replace(at_k, name=f"phalanx/{k} bound", bind_cores=True))
    if core_left and at_k.threads_per_proc > 1:  # a core per worker left to the host: placement's question
        phalanx.append(replace(at_k, name=f"phalanx/{k} core left", threads_per_proc=at_k.threads_per_proc - 1))
    if grad_dtype is not None:
        phalanx.append(replace(at_k, name=f"phalanx/{k} {grad_dtype}", grad_dtype=grad_dtype))
    if finite_check_cost:  # the default checks every 100 steps: priced against none and every step
        phalanx += [replace(at_k, name=f"phalanx/{k} {name}", check_finite_every=every)
                    for name, every in FINITE_CHECKS.items()]
    others = [
        Variant(name=f"ddp/{k}", kind="ddp", num_procs=k, threads_per_proc=1, allocator_env=False),
        Variant(name=f"ddp/{k} tuned", kind="ddp", num_procs=k, threads_per_proc=per_proc, allocator_env=True,
                memory_format="auto"),
        Variant(name=f"ceiling/{k}", kind="ceiling", num_procs=k, threads_per_proc=per_proc, allocator_env=True,
                memory_format="auto"),
        Variant(name=f"ceiling/{k} lockstep", kind="lockstep", num_procs=k, threads_per_proc=per_proc,
                allocator_env=True, memory_format="auto"),
        Variant(name="torch 1 thread", kind="torch", num_procs=1, threads_per_proc=1, allocator_env=False),
    ]
    if cores > 1:  # what a CPU user runs instead of k processes: one process on every core
        others.append(Variant(name=f"torch {cores} threads", kind="torch", num_procs=1, threads_per_proc=cores,
                              allocator_env=False))
    # phalanx/1's own yardstick: the same plain loop with phalanx's set-up (its overhead, nothing else).
    others.append(Variant(name=f"torch {cores} thread{'s' if cores > 1 else ''} tuned", kind="torch", num_procs=1, threads_per_proc=cores,
                          allocator_env=True, memory_format="auto"))
    return phalanx + others


def run_scaling_bench(config: ScalingBenchConfig, *, on_run: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure every (batch size, contender) once per round, interleaved (`--side-by-side`: in
    blocks inside shared starts); return the JSON payload."""
    cores = available_cores()
    contenders = variants(config.device_counts, cores, grad_dtype=config.grad_dtype,
                          finite_check_cost=config.finite_check_cost, core_left=config.side_by_side)
    jobs = tuple(StepJob(model=config.model, global_batch_size=batch, warmup_steps=config.warmup_steps,
                         steps=config.steps, lr=config.lr, seed=config.seed) for batch in config.global_batch_sizes)
    load: dict[str, float | None] = {}
    with cpu_taken_by_others(load):  # on a shared machine, what no contender could have
        if config.side_by_side:
            contenders, samples, wall_s, phases = side_by_side_rounds(
                contenders, jobs, device_counts=config.device_counts, cores=cores, rounds=config.rounds,
                blocks=config.blocks, timeout_s=config.timeout_s, deadline_s=config.deadline_s, on_run=on_run)
        else:
            (samples, wall_s), phases = _fresh_starts(config, contenders, jobs, on_run), None
    payload = _payload(config, cores, contenders, samples, wall_s)
    if phases is not None:  # where each step went, side by side (measure/phases.py)
        payload["phases"] = phases
    return {**payload, "others_cores": load["others_cores"], "stolen_cores": load["stolen_cores"]}


def _fresh_starts(config: ScalingBenchConfig, contenders: list[Variant], jobs: tuple[StepJob, ...],
                  on_run: Callable[[str], None] | None):
    """Each round, one fresh start per contender, running every batch size; images/s of each."""
    runs, done, wall_s = {}, [0], {}
    total = config.rounds * len(contenders)
    for variant in contenders:
        def run(variant=variant) -> dict[int, float]:
            start_s = time.perf_counter()
            records = run_jobs(variant, jobs, timeout_s=config.timeout_s, deadline_s=config.deadline_s)
            seconds = time.perf_counter() - start_s
            speeds = {job.global_batch_size: images_per_s(job, windows) for job, windows in zip(jobs, records)}
            wall_s.setdefault(variant.name, []).append(seconds)
            done[0] += 1
            if on_run is not None:  # each contender's row as it completes: a long run shows progress
                rates = ", ".join(f"global batch {batch}: {speed:.0f} images/s" for batch, speed in speeds.items())
                on_run(f"[{done[0]}/{total}] {variant.name}, {rates} ({seconds:.1f} s)")
            return speeds
        runs[variant.name] = run
    by_start = run_interleaved(runs, rounds=config.rounds, warmup_rounds=0)  # warm-up: steps in each process
    samples = {f"{batch}|{name}": [speeds[batch] for speeds in starts]
               for name, starts in by_start.items() for batch in config.global_batch_sizes}
    return samples, wall_s


def _payload(config: ScalingBenchConfig, cores: int, contenders: list[Variant], samples: dict[str, list[float]],
             wall_s: dict[str, list[float]]) -> dict[str, Any]:
    """Every contender's images/s and every ratio phalanx is judged by, from whichever of them ran."""
    results, ratios = [], []
    k = config.num_devices
    for batch in config.global_batch_sizes:
        per = {v.name: samples[f"{batch}|{v.name}"] for v in contenders}
        for variant in contenders:
            results.append({"global_batch_size": batch, "variant": variant.name,
                            "images_per_s": Spread.of(per[variant.name]).to_dict(),
                            "wall_s": Spread.of(wall_s[variant.name]).to_dict()})
        def best(names: list[str]) -> str | None:
            return max(names, key=lambda name: Spread.of(per[name]).median, default=None)

        plain = best([v.name for v in contenders if v.kind == "torch" and v.memory_format == "contiguous"])
        tuned = best([v.name for v in contenders if v.kind == "torch" and v.memory_format != "contiguous"])
        compare = [("phalanx_vs_gloo_exchange", k, f"phalanx/{k} gloo"),
                   ("phalanx_vs_ddp", k, f"ddp/{k}"),
                   ("phalanx_vs_ddp_same_setup", k, f"ddp/{k} tuned"),
                   ("phalanx_vs_best_single_process", k, plain),
                   ("phalanx_vs_best_single_process_same_setup", k, tuned),
                   ("phalanx_vs_ceiling", k, f"ceiling/{k}"),
                   ("phalanx_vs_lockstep_ceiling", k, f"ceiling/{k} lockstep"),
                   ("phalanx_1_device_vs_plain_loop_same_setup", 1, tuned)]
        if f"phalanx/{k} bound" in per:
            ratios.append({"global_batch_size": batch, "metric": "bound_cores_vs_unbound", "num_devices": k,
                           "against": f"phalanx/{k}", "numerator": f"phalanx/{k} bound",
                           "ratio": paired_ratio(per[f"phalanx/{k} bound"], per[f"phalanx/{k}"]).to_dict()})
        ratios.append({"global_batch_size": batch, "metric": "overlapped_vs_default", "num_devices": k,
                       "against": f"phalanx/{k}", "numerator": f"phalanx/{k} overlapped",
                       "ratio": paired_ratio(per[f"phalanx/{k} overlapped"], per[f"phalanx/{k}"]).to_dict()})
        if f"phalanx/{k} core left" in per:
            ratios.append({"global_batch_size": batch, "metric": "core_left_vs_default", "num_devices": k,
                           "against": f"phalanx/{k}", "numerator": f"phalanx/{k} core left",
                           "ratio": paired_ratio(per[f"phalanx/{k} core left"], per[f"phalanx/{k}"]).to_dict()})
        ratios.append({"global_batch_size": batch, "metric": "lockstep_vs_ceiling", "num_devices": k,
                       "against": f"ceiling/{k}", "numerator": f"ceiling/{k} lockstep",
                       "ratio": paired_ratio(per[f"ceiling/{k} lockstep"], per[f"ceiling/{k}"]).to_dict()})
        for metric, j, against in ((m, j, a) for m, j, a in compare if a in per):  # those that ran
            ratios.append({"global_batch_size": batch, "metric": metric, "num_devices": j, "against": against,
                           "ratio": paired_ratio(per[f"phalanx/{j}"], per[against]).to_dict()})
        if config.grad_dtype is not None:
            name = f"phalanx/{k} {config.grad_dtype}"
            ratios.append({"global_batch_size": batch, "metric": f"{config.grad_dtype}_exchange_vs_float32",
                           "num_devices": k, "against": f"phalanx/{k}", "numerator": name,
                           "ratio": paired_ratio(per[name], per[f"phalanx/{k}"]).to_dict()})
        if config.finite_check_cost:
            off = f"phalanx/{k} no finite check"
            for metric, name in (("finite_check_default_vs_off", f"phalanx/{k}"),
                                 ("finite_check_every_step_vs_off", f"phalanx/{k} finite check every step")):
                ratios.append({"global_batch_size": batch, "metric": metric, "num_devices": k, "against": off,
                               "numerator": name, "ratio": paired_ratio(per[name], per[off]).to_dict()})
        for j in (j for j in config.phalanx_counts if j > 1):
            ratios.append({"global_batch_size": batch, "metric": "speedup", "num_devices": j, "against": "phalanx/1",
                           "ratio": paired_ratio(per[f"phalanx/{j}"], per["phalanx/1"]).to_dict()})
            ratios.append({"global_batch_size": batch, "metric": "scaling_efficiency", "num_devices": j,
                           "against": f"{j} x phalanx/1",
                           "ratio": paired_ratio(per[f"phalanx/{j}"], [j * s for s in per["phalanx/1"]]).to_dict()})
    method = "side by side" if config.side_by_side else "fresh starts"
    return {"bench": "scaling", "config": asdict(config), "cores": cores, "method": method,
            "phalanx_data_parallel": data_parallel_defaults(),
            "variants": [asdict(v) for v in contenders], "results": results, "ratios": ratios}


def data_parallel_defaults() -> dict[str, Any]:
    """The settings phalanx ran with (a replica's default options), so a result names what it measured."""
    return {f.name: f.default for f in fields(DataParallelConfig)}
