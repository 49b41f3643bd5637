"""`phalanx bench scaling`: training throughput of phalanx against what a user would run instead.

Contenders, on synthetic data held in memory (one fixed random batch, so data time is zero for
all): phalanx on 1..k devices (DataParallel + train_batch, started by `phalanx.runtime.launch`: its
allocator setting and cores/k threads, its default allreduce - shm on one host); phalanx on k
devices exchanging over gloo instead (what the shared-memory transport buys); phalanx on k
devices with each worker bound to its own cores (`--bind-cores`, when k <= cores); torch DDP
on k processes as a DDP user gets it (plain `DistributedDataParallel`, gloo, default buckets, 1
thread each, no allocator setting; procs.py);
one plain PyTorch process with 1 thread and with every core; and the ceiling, k processes set up
as phalanx's that train their shards with no communication at all. Every (contender, batch
size) runs in fresh processes: warm-up steps, a barrier, timed steps; images/s uses the slowest
rank's time. Configurations are interleaved round by round, and each ratio is the median of
per-round ratios. Scaling efficiency is images/s on j devices / (j x images/s on 1).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from phalanx.measure.mlp import BENCH_MODELS, build_bench_model
from phalanx.measure.procs import run_fresh
from phalanx.measure.timing import Spread, paired_ratio, run_interleaved
from phalanx.data import split_batch
from phalanx.runtime.devices import parse_devices
from phalanx.runtime.binding import available_cores
from phalanx.runtime.launch import LaunchSpec, launch
from phalanx.data_parallel import GRAD_DTYPES, DataParallel, apply_memory_format, prepare, resolve_memory_format
from phalanx.train.loop import train_batch
from phalanx.runtime.world import World

KINDS = ("phalanx", "ddp", "torch", "ceiling")


@dataclass(frozen=True, kw_only=True)
class ScalingBenchConfig:
    model: str = "lenet"
    global_batch_sizes: tuple[int, ...] = (256, 1024)
    num_devices: int = 2
    warmup_steps: int = 2
    steps: int = 6
    rounds: int = 3
    lr: float = 0.2  # BASELINES.md's setting; the update's size does not change its cost
    seed: int = 0
    timeout_s: float = 120.0  # bound on one collective
    deadline_s: float = 600.0  # bound on one configuration's processes
    grad_dtype: str | None = None  # also time phalanx/k exchanging gradients compressed to this

    def __post_init__(self) -> None:
        if self.grad_dtype is not None and self.grad_dtype not in GRAD_DTYPES:
            raise ValueError(f"--grad-dtype {self.grad_dtype!r} is unknown; choose one of {', '.join(GRAD_DTYPES)}")
        if self.model not in BENCH_MODELS:
            raise ValueError(f"unknown model {self.model!r}; choose one of {', '.join(BENCH_MODELS)}")
        if self.num_devices < 2:
            raise ValueError(f"num_devices must be at least 2 to compare scaling, got {self.num_devices}")
        small = [b for b in self.global_batch_sizes if b < self.num_devices]
        if not self.global_batch_sizes or small:
            raise ValueError(f"every global batch size must be >= num_devices {self.num_devices} "
                             f"(one example per device), got {list(self.global_batch_sizes)}")
        for name, low in (("steps", 1), ("rounds", 1), ("warmup_steps", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be at least {low}, got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class Variant:
    name: str  # "phalanx/2", "ddp/2", "torch 1 thread", ...
    kind: str  # one of KINDS
    num_procs: int
    threads_per_proc: int
    allocator_env: bool
    memory_format: str = "contiguous"  # phalanx's runs: "auto" (channels_last for CPU conv nets)
    grad_dtype: str | None = None  # phalanx's runs: exchange compressed (bf16 / fp16)
    algorithm: str = "auto"  # phalanx's runs: the allreduce
    bind_cores: bool = False  # phalanx's runs: each worker pinned to its own cores (--bind-cores)


@dataclass(frozen=True, kw_only=True)
class StepJob:
    """What one configuration's processes run: picklable, the same for every rank."""

    model: str
    global_batch_size: int
    num_shards: int
    warmup_steps: int
    steps: int
    lr: float
    seed: int
    memory_format: str = "contiguous"
    grad_dtype: str | None = None
    algorithm: str = "auto"


def variants(num_devices: int, cores: int, *, grad_dtype: str | None = None) -> list[Variant]:
    """The contenders. "tuned" ones get phalanx's CPU set-up (allocator env, memory format), so
    the table separates what phalanx's defaults buy from what its engine does."""
    k, per_proc = num_devices, max(1, cores // num_devices)
    phalanx = [Variant(name=f"phalanx/{j}", kind="phalanx", num_procs=j, threads_per_proc=max(1, cores // j),
                       allocator_env=True, memory_format="auto") for j in range(1, k + 1)]
    phalanx.append(replace(phalanx[-1], name=f"phalanx/{k} gloo", algorithm="native"))
    if k <= cores:  # --bind-cores: where the workers run, priced beside the default
        phalanx.append(replace(phalanx[k - 1], name=f"phalanx/{k} bound", bind_cores=True))
    if grad_dtype is not None:
        phalanx.append(replace(phalanx[k - 1], name=f"phalanx/{k} {grad_dtype}", grad_dtype=grad_dtype))
    others = [
        Variant(name=f"ddp/{k}", kind="ddp", num_procs=k, threads_per_proc=1, allocator_env=False),
        Variant(name=f"ddp/{k} tuned", kind="ddp", num_procs=k, threads_per_proc=per_proc, allocator_env=True,
                memory_format="auto"),
        Variant(name=f"ceiling/{k}", kind="ceiling", num_procs=k, threads_per_proc=per_proc, allocator_env=True,
                memory_format="auto"),
        Variant(name="torch 1 thread", kind="torch", num_procs=1, threads_per_proc=1, allocator_env=False),
    ]
    if cores > 1:  # what a CPU user runs instead of k processes: one process on every core
        others.append(Variant(name=f"torch {cores} threads", kind="torch", num_procs=1, threads_per_proc=cores,
                              allocator_env=False))
    # phalanx/1's own yardstick: the same plain loop with phalanx's set-up (its overhead, nothing else).
    others.append(Variant(name=f"torch {cores} thread{'s' if cores > 1 else ''} tuned", kind="torch", num_procs=1, threads_per_proc=cores,
                          allocator_env=True, memory_format="auto"))
    return phalanx + others


def _build(job: StepJob) -> torch.nn.Module:
    model = build_bench_model(job.model)
    return apply_memory_format(model, resolve_memory_format(job.memory_format, model, torch.device("cpu")))


def _shard(job: StepJob, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(job.seed)  # every rank draws the same global batch
    X = torch.randn(job.global_batch_size, 1, 28, 28, generator=generator)
    y = torch.randint(0, 10, (job.global_batch_size,), generator=generator)
    X_shard, y_shard = split_batch(X, y, job.num_shards)[rank]
    return X_shard.contiguous(), y_shard.contiguous()


def _timed_steps(step: Callable[[], object], job: StepJob, barrier: Callable[[], object]) -> float:
    for _ in range(job.warmup_steps):
        step()
    barrier()  # every rank starts the clock together
    start_s = time.perf_counter()
    for _ in range(job.steps):
        step()
    return time.perf_counter() - start_s


def _barrier(world: World) -> Callable[[], object]:
    return dist.barrier if world.distributed else (lambda: None)


def _phalanx_worker(world: World, job: StepJob) -> float:
    torch.manual_seed(job.seed)
    X, y = _shard(job, world.rank)
    with prepare(build_bench_model(job.model), world=world, memory_format=job.memory_format,
                 grad_dtype=job.grad_dtype, algorithm=job.algorithm) as dp:
        optimizer = torch.optim.SGD(dp.module.parameters(), lr=job.lr)

        def step() -> None:
            train_batch(dp, optimizer, X, y, global_batch_size=job.global_batch_size)

        return _timed_steps(step, job, _barrier(world))


def _phalanx_single(*, rank: int, num_procs: int, port: int, job: StepJob) -> float:
    # One device runs in the launcher's own process; this fresh process stands in for it.
    return launch(_phalanx_worker, job, spec=LaunchSpec(plan=parse_devices("cpu:1", cuda_count=0)))[0]


def _plain_step(model, optimizer, X, y, *, global_batch_size: int) -> Callable[[], None]:
    def step() -> None:
        optimizer.zero_grad()
        (F.cross_entropy(model(X), y, reduction="sum") / global_batch_size).backward()
        optimizer.step()
    return step


def _ceiling_worker(world: World, job: StepJob) -> float:
    """phalanx's worker set-up, its shard, the same scaled loss: everything but the allreduce."""
    torch.manual_seed(job.seed)
    model = _build(job)
    X, y = _shard(job, world.rank)
    step = _plain_step(model, torch.optim.SGD(model.parameters(), lr=job.lr), X, y,
                       global_batch_size=job.global_batch_size)
    return _timed_steps(step, job, _barrier(world))


def _ddp_worker(*, rank: int, num_procs: int, port: int, job: StepJob) -> float:
    """What the PyTorch tutorial does: gloo process group, DDP with its defaults, mean loss."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_procs)
    torch.manual_seed(job.seed)
    model = torch.nn.parallel.DistributedDataParallel(_build(job))
    X, y = _shard(job, rank)
    step = _plain_step(model, torch.optim.SGD(model.parameters(), lr=job.lr), X, y, global_batch_size=X.shape[0])
    return _timed_steps(step, job, dist.barrier)


def _torch_worker(*, rank: int, num_procs: int, port: int, job: StepJob) -> float:
    torch.manual_seed(job.seed)
    model = _build(job)
    X, y = _shard(job, rank)
    step = _plain_step(model, torch.optim.SGD(model.parameters(), lr=job.lr), X, y,
                       global_batch_size=job.global_batch_size)
    return _timed_steps(step, job, lambda: None)


def run_variant(variant: Variant, job: StepJob, config: ScalingBenchConfig) -> float:
    """Images/s of one configuration in fresh processes (the slowest rank's time counts)."""
    job = replace(job, num_shards=variant.num_procs, memory_format=variant.memory_format, grad_dtype=variant.grad_dtype,
                  algorithm=variant.algorithm)
    if variant.kind in ("phalanx", "ceiling") and variant.num_procs > 1:
        fn = _phalanx_worker if variant.kind == "phalanx" else _ceiling_worker
        spec = LaunchSpec(plan=parse_devices(f"cpu:{variant.num_procs}", cuda_count=0),
                          threads_per_device=variant.threads_per_proc, timeout_s=config.timeout_s,
                          deadline_s=config.deadline_s, bind_cores=variant.bind_cores)
        elapsed = launch(fn, job, spec=spec)
    else:
        fn = {"phalanx": _phalanx_single, "ddp": _ddp_worker, "torch": _torch_worker}[variant.kind]
        elapsed = run_fresh(fn, job, num_procs=variant.num_procs, threads=variant.threads_per_proc,
                            tune_allocator=variant.allocator_env, deadline_s=config.deadline_s, name=variant.name)
    return job.global_batch_size * job.steps / max(elapsed)


def run_scaling_bench(config: ScalingBenchConfig, *, on_run: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure every (batch size, contender) once per round, interleaved; return the JSON payload."""
    cores = available_cores()
    contenders = variants(config.num_devices, cores, grad_dtype=config.grad_dtype)
    runs, started = {}, [0]
    total = config.rounds * len(config.global_batch_sizes) * len(contenders)
    for batch in config.global_batch_sizes:
        job = StepJob(model=config.model, global_batch_size=batch, num_shards=1, warmup_steps=config.warmup_steps,
                      steps=config.steps, lr=config.lr, seed=config.seed)
        for variant in contenders:
            def run(variant=variant, job=job) -> float:
                started[0] += 1
                if on_run is not None:
                    on_run(f"[{started[0]}/{total}] {variant.name}, global batch {job.global_batch_size}")
                return run_variant(variant, job, config)
            runs[f"{batch}|{variant.name}"] = run
    samples = run_interleaved(runs, rounds=config.rounds, warmup_rounds=0)  # warm-up: steps in each process
    results, ratios = [], []
    k = config.num_devices
    for batch in config.global_batch_sizes:
        per = {v.name: samples[f"{batch}|{v.name}"] for v in contenders}
        for variant in contenders:
            results.append({"global_batch_size": batch, "variant": variant.name,
                            "images_per_s": Spread.of(per[variant.name]).to_dict()})
        def best(names: list[str]) -> str:
            return max(names, key=lambda name: Spread.of(per[name]).median)

        plain = best([v.name for v in contenders if v.kind == "torch" and v.memory_format == "contiguous"])
        tuned = best([v.name for v in contenders if v.kind == "torch" and v.memory_format != "contiguous"])
        compare = [("phalanx_vs_gloo_exchange", k, f"phalanx/{k} gloo"),
                   ("phalanx_vs_ddp", k, f"ddp/{k}"),
                   ("phalanx_vs_ddp_same_setup", k, f"ddp/{k} tuned"),
                   ("phalanx_vs_best_single_process", k, plain),
                   ("phalanx_vs_best_single_process_same_setup", k, tuned),
                   ("phalanx_vs_ceiling", k, f"ceiling/{k}"),
                   ("phalanx_1_device_vs_plain_loop_same_setup", 1, tuned)]
        if f"phalanx/{k} bound" in per:
            ratios.append({"global_batch_size": batch, "metric": "bound_cores_vs_unbound", "num_devices": k,
                           "against": f"phalanx/{k}", "numerator": f"phalanx/{k} bound",
                           "ratio": paired_ratio(per[f"phalanx/{k} bound"], per[f"phalanx/{k}"]).to_dict()})
        for metric, j, against in compare:
            ratios.append({"global_batch_size": batch, "metric": metric, "num_devices": j, "against": against,
                           "ratio": paired_ratio(per[f"phalanx/{j}"], per[against]).to_dict()})
        if config.grad_dtype is not None:
            name = f"phalanx/{k} {config.grad_dtype}"
            ratios.append({"global_batch_size": batch, "metric": f"{config.grad_dtype}_exchange_vs_float32",
                           "num_devices": k, "against": f"phalanx/{k}", "numerator": name,
                           "ratio": paired_ratio(per[name], per[f"phalanx/{k}"]).to_dict()})
        for j in range(2, k + 1):
            ratios.append({"global_batch_size": batch, "metric": "scaling_efficiency", "num_devices": j,
                           "against": f"{j} x phalanx/1",
                           "ratio": paired_ratio(per[f"phalanx/{j}"], [j * s for s in per["phalanx/1"]]).to_dict()})
    return {"bench": "scaling", "config": asdict(config), "cores": cores,
            "phalanx_data_parallel": data_parallel_defaults(),
            "variants": [asdict(v) for v in contenders], "results": results, "ratios": ratios}


def data_parallel_defaults() -> dict[str, Any]:
    """The settings phalanx ran with (DataParallel's defaults), so a result names what it measured."""
    return {name: param.default for name, param in inspect.signature(DataParallel).parameters.items()
            if isinstance(param.default, (bool, int, float, str)) or (param.default is None and name != "comm")}
