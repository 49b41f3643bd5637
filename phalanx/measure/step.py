"""The scaling and memory worker: phalanx's training step timed on synthetic data, and what it is judged against.

One configuration (a `Variant`: which program, how many processes, threads each, the allocator
setting, memory format, exchange, ZeRO stage) runs a `StepJob` (job_steps.py: model, batch, steps, optimizer)
in fresh processes; `run_jobs` runs several jobs (bench scaling's batch sizes) one after the
other in one start of those processes, each job with a model and replica of its own. Every rank
draws the same fixed random global batch (data time is zero for all), takes its `split_batch`
shard, runs the warm-up steps, meets the others at a barrier and times `steps` steps in a
`busy_window` (wall time, its own CPU time, the host's busy time); it also reports its resident
set around the run and the bytes of parameters, gradients and optimizer state it holds after it
(memory.py). The kinds:

- `phalanx`: `phalanx.prepare` (with `shard=`) and `train_batch`, the step training runs, started
  by `phalanx.runtime.launch` (its allocator setting, threads, core binding); one device runs
  in a fresh process of its own that launches it, as `phalanx train --devices 1` would;
- `ceiling`: phalanx's worker set-up, shard and scaled loss with no exchange at all;
- `lockstep`: the ceiling whose ranks meet at every step, after backward where phalanx's ranks
  exchange, through a 4-byte allreduce of the algorithm phalanx's auto picks: what waiting for
  the slowest rank at every step costs on this host, the exchange's bytes left out;
- `ddp`: torch DDP as its tutorial runs it (gloo, default buckets, mean loss), via procs.py;
  `zero`: the same with `ZeroRedundancyOptimizer`; `fsdp2`: FSDP2's `fully_shard` per layer;
- `torch`: the plain PyTorch loop in one process.

BatchNorm, where a model has it, computes each rank's own batch statistics in every kind
(phalanx's `batchnorm="local"`), so a timing compares the exchange, not the BatchNorm policy.
`run_jobs` returns every job's list of every rank's record (`run_variant` one job's);
`images_per_s` counts the slowest rank's time. bench scaling fields the kinds but zero and fsdp2,
bench memory phalanx's stages and ddp, zero and fsdp2; predict --validate measures the `phalanx`
one, so its check is bench scaling's number by construction.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from phalanx.data_parallel.guards.finite import DEFAULT_CHECK_FINITE_EVERY
from phalanx.measure.job_steps import (OPTIMIZERS, StepJob, build_model, lockstep_meeting, phalanx_step,
                                       plain_optimizer, plain_step, prepare_replica, world_barrier)
from phalanx.measure.load import busy_window
from phalanx.measure.memory import MemoryProbe, held_bytes, replica_held_bytes
from phalanx.measure.procs import run_fresh
from phalanx.runtime.devices import parse_devices
from phalanx.runtime.launch import LaunchSpec, launch
from phalanx.runtime.world import World

KINDS = ("phalanx", "ddp", "zero", "fsdp2", "torch", "ceiling", "lockstep")



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
    shard: str = "none"  # phalanx's runs: the ZeRO stage (none, optimizer, gradients, parameters)
    overlap: bool | None = None  # phalanx's runs: the exchange beside backward (None: auto)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind {self.kind!r} is unknown; choose one of {', '.join(KINDS)}")


def _timed_steps(step: Callable[[], object], job: StepJob, barrier: Callable[[], object], *, probe: MemoryProbe,
                 held: Callable[[], dict]) -> dict:
    """Warm-up, a barrier, the timed steps: this rank's busy_window, its resident set around
    the run and the bytes it holds after (memory.py)."""
    probe.built()
    for _ in range(job.warmup_steps):
        step()
        probe.stepped()
    barrier()  # every rank starts the clock together
    with busy_window() as window:
        for _ in range(job.steps):
            step()
            probe.stepped()  # a counter; one read of /proc/self/status at EARLY_STEPS (~50 µs)
    return {**window, **probe.finished(held())}


def _each_job(jobs: Sequence[StepJob], run_one: Callable[[StepJob, MemoryProbe], dict], *,
              probe: MemoryProbe) -> list[dict]:
    """`run_one(job, probe)` for each job in turn, the torch seed set to the job's first: the first
    job with `probe` (made first thing in the worker, before any group or model), each later one
    with a probe of its own made as it begins."""
    records = []
    for index, job in enumerate(jobs):
        torch.manual_seed(job.seed)
        records.append(run_one(job, probe if index == 0 else MemoryProbe()))
    return records


def _phalanx_worker(world: World, jobs: tuple[StepJob, ...]) -> list[dict]:
    def one(job: StepJob, probe: MemoryProbe) -> dict:
        with prepare_replica(job, world) as dp:
            optimizer = dp.optimizer(OPTIMIZERS[job.optimizer], lr=job.lr)
            return _timed_steps(phalanx_step(dp, optimizer, job, rank=world.rank), job, world_barrier(world),
                                probe=probe, held=lambda: replica_held_bytes(dp, optimizer))

    return _each_job(jobs, one, probe=MemoryProbe())


def _phalanx_single(*, rank: int, num_procs: int, port: int, job: tuple[StepJob, ...]) -> list[dict]:
    # One device runs in the launcher's own process; this fresh process stands in for it.
    spec = LaunchSpec(plan=parse_devices("cpu:1", cuda_count=0), threads_per_device=job[0].threads_per_device)
    return launch(_phalanx_worker, job, spec=spec)[0]


def _plain_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, job: StepJob, *, rank: int,
                 mean_loss: bool, barrier: Callable[[], object], probe: MemoryProbe,
                 meet: Callable[[], object] | None = None) -> dict:
    """`_timed_steps` of the plain PyTorch step on this rank's shard: the loss summed over the
    global batch (phalanx's scaling), or the mean over the shard (`mean_loss`: DDP's, FSDP's);
    `meet()`, if given, after backward (the lockstep ceiling's meeting)."""
    step = plain_step(model, optimizer, job, rank=rank, mean_loss=mean_loss, meet=meet)
    return _timed_steps(step, job, barrier, probe=probe, held=lambda: held_bytes(model.parameters(), optimizer))


def _plain_model_steps(job: StepJob, probe: MemoryProbe, *, rank: int, barrier: Callable[[], object],
                       meet: Callable[[], object] | None = None) -> dict:
    """`_plain_steps` of a fresh model with its own optimizer, the loss scaled as phalanx's."""
    model = build_model(job)
    return _plain_steps(model, plain_optimizer(model.parameters(), job), job, rank=rank, mean_loss=False,
                        barrier=barrier, probe=probe, meet=meet)


def _ceiling_worker(world: World, jobs: tuple[StepJob, ...], *, lockstep: bool = False) -> list[dict]:
    """phalanx's worker set-up, its shard, the same scaled loss: everything but the allreduce;
    `lockstep`: with the ranks meeting at every step (a 4-byte allreduce, phalanx's auto one)."""
    probe = MemoryProbe()
    with contextlib.ExitStack() as stack:
        meet = lockstep_meeting(world, stack) if lockstep else None
        return _each_job(jobs, lambda job, job_probe: _plain_model_steps(job, job_probe, rank=world.rank,
                                                                         barrier=world_barrier(world), meet=meet),
                         probe=probe)


def _lockstep_worker(world: World, jobs: tuple[StepJob, ...]) -> list[dict]:
    return _ceiling_worker(world, jobs, lockstep=True)


def _join(rank: int, num_procs: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_procs)


def _ddp_worker(*, rank: int, num_procs: int, port: int, job: tuple[StepJob, ...], zero: bool = False) -> list[dict]:
    """What the PyTorch tutorial does: gloo process group, DDP with its defaults, mean loss;
    `zero`: its optimizer a ZeroRedundancyOptimizer (each rank the state of its parameters)."""
    # Imported here, not above: importing torch.distributed.optim jit-scripts its functional
    # optimizers, 66 DeprecationWarnings in every process that would import this module.
    from torch.distributed.optim import ZeroRedundancyOptimizer

    probe = MemoryProbe()
    _join(rank, num_procs, port)

    def one(job: StepJob, probe: MemoryProbe) -> dict:
        model = torch.nn.parallel.DistributedDataParallel(build_model(job))
        optimizer = (ZeroRedundancyOptimizer(model.parameters(), optimizer_class=OPTIMIZERS[job.optimizer], lr=job.lr)
                     if zero else plain_optimizer(model.parameters(), job))
        return _plain_steps(model, optimizer, job, rank=rank, mean_loss=True, barrier=dist.barrier, probe=probe)

    return _each_job(job, one, probe=probe)


def _zero_worker(*, rank: int, num_procs: int, port: int, job: tuple[StepJob, ...]) -> list[dict]:
    return _ddp_worker(rank=rank, num_procs=num_procs, port=port, job=job, zero=True)


def _fsdp2_worker(*, rank: int, num_procs: int, port: int, job: tuple[StepJob, ...]) -> list[dict]:
    """FSDP2 as its docs set it up: `fully_shard` on each layer that holds parameters, then on the
    root, over a 1-D CPU mesh (gloo); the optimizer over the sharded (DTensor) parameters."""
    # Imported here, not above: DTensor's package takes 0.4 s to import, in every fresh process
    # of bench scaling and predict that imports this module and never runs FSDP2.
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch 2.4 and 2.5 keep it in the composable APIs
        from torch.distributed._composable.fsdp import fully_shard

    probe = MemoryProbe()
    _join(rank, num_procs, port)
    mesh = init_device_mesh("cpu", (num_procs,))

    def one(job: StepJob, probe: MemoryProbe) -> dict:
        model = build_model(job)
        for layer in [m for m in model.modules()
                      if m is not model and next(m.parameters(recurse=False), None) is not None]:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return _plain_steps(model, plain_optimizer(model.parameters(), job), job, rank=rank, mean_loss=True,
                            barrier=dist.barrier, probe=probe)

    return _each_job(job, one, probe=probe)


def _torch_worker(*, rank: int, num_procs: int, port: int, job: tuple[StepJob, ...]) -> list[dict]:
    return _each_job(job, lambda one, probe: _plain_model_steps(one, probe, rank=rank, barrier=lambda: None),
                     probe=MemoryProbe())


def run_jobs(variant: Variant, jobs: Sequence[StepJob], *, timeout_s: float, deadline_s: float) -> list[list[dict]]:
    """Run `jobs` one after the other as `variant`, in one start of fresh processes; for each job,
    every rank's record: its busy_window (wall_s, cpu_s, host_busy_s) and its memory
    (memory.MemoryProbe's: resident set, bytes held)."""
    jobs = tuple(replace(job, num_shards=variant.num_procs, threads_per_device=variant.threads_per_proc,
                         memory_format=variant.memory_format, grad_dtype=variant.grad_dtype,
                         algorithm=variant.algorithm, check_finite_every=variant.check_finite_every,
                         shard=variant.shard, overlap=variant.overlap) for job in jobs)
    if variant.kind in ("phalanx", "ceiling", "lockstep") and variant.num_procs > 1:
        fn = {"phalanx": _phalanx_worker, "ceiling": _ceiling_worker, "lockstep": _lockstep_worker}[variant.kind]
        spec = LaunchSpec(plan=parse_devices(f"cpu:{variant.num_procs}", cuda_count=0),
                          threads_per_device=variant.threads_per_proc, timeout_s=timeout_s,
                          deadline_s=deadline_s, bind_cores=variant.bind_cores)
        by_rank = launch(fn, jobs, spec=spec)
    else:
        fn = {"phalanx": _phalanx_single, "ddp": _ddp_worker, "zero": _zero_worker, "fsdp2": _fsdp2_worker,
              "torch": _torch_worker, "ceiling": _torch_worker, "lockstep": _torch_worker}[variant.kind]
        by_rank = run_fresh(fn, jobs, num_procs=variant.num_procs, threads=variant.threads_per_proc,
                            tune_allocator=variant.allocator_env, deadline_s=deadline_s, name=variant.name)
    return [[records[i] for records in by_rank] for i in range(len(jobs))]


def run_variant(variant: Variant, job: StepJob, *, timeout_s: float, deadline_s: float) -> list[dict]:
    """`run_jobs` of one job: every rank's record."""
    return run_jobs(variant, (job,), timeout_s=timeout_s, deadline_s=deadline_s)[0]


def images_per_s(job: StepJob, windows: list[dict]) -> float:
    """Images per second of a lockstep run: the global batch times the steps over the slowest rank's wall time."""
    return job.global_batch_size * job.steps / max(w["wall_s"] for w in windows)
