"""The scaling worker: phalanx's training step timed on synthetic data, and what it is judged against.

One configuration (a `Variant`: which program, how many processes, threads each, the allocator
setting, memory format, exchange) runs a `StepJob` in fresh processes. Every rank draws the same
fixed random global batch (data time is zero for all), takes its `split_batch` shard, runs the
warm-up steps, meets the others at a barrier and times `steps` steps in a `busy_window` (wall
time, its own CPU time, the host's busy time). The kinds:

- `phalanx`: `phalanx.prepare` and `train_batch`, the step training runs, started by
  `phalanx.runtime.launch` (its allocator setting, threads, core binding); one device runs in a
  fresh process of its own that launches it, as `phalanx train --devices 1` would;
- `ceiling`: phalanx's worker set-up, shard and scaled loss with no exchange at all;
- `ddp`: torch DDP as its tutorial runs it (gloo, default buckets, mean loss), via procs.py;
- `torch`: the plain PyTorch loop in one process.

`run_variant` returns every rank's window; `images_per_s` counts the slowest rank's time. bench
scaling fields all the kinds; predict --validate measures the `phalanx` one, so its check is
bench scaling's number by construction.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from phalanx.data import split_batch
from phalanx.data_parallel import DEFAULT_BUCKET_CAP_MB, apply_memory_format, prepare, resolve_memory_format
from phalanx.data_parallel.finite import DEFAULT_CHECK_FINITE_EVERY
from phalanx.measure.load import busy_window
from phalanx.measure.mlp import build_bench_model
from phalanx.measure.procs import run_fresh
from phalanx.runtime.devices import parse_devices
from phalanx.runtime.launch import LaunchSpec, launch
from phalanx.runtime.world import World
from phalanx.train.loop import train_batch

KINDS = ("phalanx", "ddp", "torch", "ceiling")


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
    check_finite_every: int = DEFAULT_CHECK_FINITE_EVERY  # phalanx's runs: the gradient's NaN/Inf check (0: off)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind {self.kind!r} is unknown; choose one of {', '.join(KINDS)}")


@dataclass(frozen=True, kw_only=True)
class StepJob:
    """What one configuration's processes run: picklable, the same for every rank."""

    model: str
    global_batch_size: int
    warmup_steps: int
    steps: int
    lr: float
    seed: int
    num_shards: int = 1  # run_variant sets this and the fields below from the Variant
    threads_per_device: int | None = None
    memory_format: str = "contiguous"
    grad_dtype: str | None = None
    algorithm: str = "auto"
    bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB
    check_finite_every: int = DEFAULT_CHECK_FINITE_EVERY


def _build(job: StepJob) -> torch.nn.Module:
    model = build_bench_model(job.model)
    return apply_memory_format(model, resolve_memory_format(job.memory_format, model, torch.device("cpu")))


def _shard(job: StepJob, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(job.seed)  # every rank draws the same global batch
    X = torch.randn(job.global_batch_size, 1, 28, 28, generator=generator)
    y = torch.randint(0, 10, (job.global_batch_size,), generator=generator)
    X_shard, y_shard = split_batch(X, y, job.num_shards)[rank]
    return X_shard.contiguous(), y_shard.contiguous()


def _timed_steps(step: Callable[[], object], job: StepJob, barrier: Callable[[], object]) -> dict:
    for _ in range(job.warmup_steps):
        step()
    barrier()  # every rank starts the clock together
    with busy_window() as window:
        for _ in range(job.steps):
            step()
    return window


def _barrier(world: World) -> Callable[[], object]:
    return dist.barrier if world.distributed else (lambda: None)


def _phalanx_worker(world: World, job: StepJob) -> dict:
    torch.manual_seed(job.seed)
    X, y = _shard(job, world.rank)
    with prepare(build_bench_model(job.model), world=world, memory_format=job.memory_format,
                 grad_dtype=job.grad_dtype, algorithm=job.algorithm, bucket_cap_mb=job.bucket_cap_mb,
                 check_finite_every=job.check_finite_every) as dp:
        optimizer = torch.optim.SGD(dp.module.parameters(), lr=job.lr)

        def step() -> None:
            train_batch(dp, optimizer, X, y, global_batch_size=job.global_batch_size)

        return _timed_steps(step, job, _barrier(world))


def _phalanx_single(*, rank: int, num_procs: int, port: int, job: StepJob) -> dict:
    # One device runs in the launcher's own process; this fresh process stands in for it.
    spec = LaunchSpec(plan=parse_devices("cpu:1", cuda_count=0), threads_per_device=job.threads_per_device)
    return launch(_phalanx_worker, job, spec=spec)[0]


def _plain_step(model, optimizer, X, y, *, global_batch_size: int) -> Callable[[], None]:
    def step() -> None:
        optimizer.zero_grad()
        (F.cross_entropy(model(X), y, reduction="sum") / global_batch_size).backward()
        optimizer.step()
    return step


def _ceiling_worker(world: World, job: StepJob) -> dict:
    """phalanx's worker set-up, its shard, the same scaled loss: everything but the allreduce."""
    torch.manual_seed(job.seed)
    model = _build(job)
    X, y = _shard(job, world.rank)
    step = _plain_step(model, torch.optim.SGD(model.parameters(), lr=job.lr), X, y,
                       global_batch_size=job.global_batch_size)
    return _timed_steps(step, job, _barrier(world))


def _ddp_worker(*, rank: int, num_procs: int, port: int, job: StepJob) -> dict:
    """What the PyTorch tutorial does: gloo process group, DDP with its defaults, mean loss."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_procs)
    torch.manual_seed(job.seed)
    model = torch.nn.parallel.DistributedDataParallel(_build(job))
    X, y = _shard(job, rank)
    step = _plain_step(model, torch.optim.SGD(model.parameters(), lr=job.lr), X, y, global_batch_size=X.shape[0])
    return _timed_steps(step, job, dist.barrier)


def _torch_worker(*, rank: int, num_procs: int, port: int, job: StepJob) -> dict:
    torch.manual_seed(job.seed)
    model = _build(job)
    X, y = _shard(job, rank)
    step = _plain_step(model, torch.optim.SGD(model.parameters(), lr=job.lr), X, y,
                       global_batch_size=job.global_batch_size)
    return _timed_steps(step, job, lambda: None)


def run_variant(variant: Variant, job: StepJob, *, timeout_s: float, deadline_s: float) -> list[dict]:
    """Run `job` as `variant` in fresh processes; every rank's busy_window (wall_s, cpu_s, host_busy_s)."""
    job = replace(job, num_shards=variant.num_procs, threads_per_device=variant.threads_per_proc,
                  memory_format=variant.memory_format, grad_dtype=variant.grad_dtype, algorithm=variant.algorithm,
                  check_finite_every=variant.check_finite_every)
    if variant.kind in ("phalanx", "ceiling") and variant.num_procs > 1:
        fn = _phalanx_worker if variant.kind == "phalanx" else _ceiling_worker
        spec = LaunchSpec(plan=parse_devices(f"cpu:{variant.num_procs}", cuda_count=0),
                          threads_per_device=variant.threads_per_proc, timeout_s=timeout_s,
                          deadline_s=deadline_s, bind_cores=variant.bind_cores)
        return launch(fn, job, spec=spec)
    fn = {"phalanx": _phalanx_single, "ddp": _ddp_worker, "torch": _torch_worker,
          "ceiling": _torch_worker}[variant.kind]
    return run_fresh(fn, job, num_procs=variant.num_procs, threads=variant.threads_per_proc,
                     tune_allocator=variant.allocator_env, deadline_s=deadline_s, name=variant.name)


def images_per_s(job: StepJob, windows: list[dict]) -> float:
    """Images per second of a lockstep run: the global batch times the steps over the slowest rank's wall time."""
    return job.global_batch_size * job.steps / max(w["wall_s"] for w in windows)
