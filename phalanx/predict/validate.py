"""The check: measure phalanx on k devices exactly as `bench scaling` measures its phalanx contender.

k CPU workers started by `phalanx.runtime.launch` (its allocator setting, cores // k threads each, at
least 1), DataParallel with the prediction's algorithm and bucket cap (bench scaling's defaults:
native, 0.25 MB), channels_last for conv nets, one fixed random global batch in memory, each
rank training its `split_batch` shard with `train_batch`; warm-up steps, a barrier, timed steps;
images/s from the slowest rank's time. One device runs in a fresh process of its own, as bench
scaling's phalanx/1 does. With the defaults this is bench scaling's `phalanx/k` line for line.
Beside images/s it notes how many cores other programs kept busy during the timed steps (the
host's busy time from /proc/stat minus the workers' own CPU time), so a prediction can be
compared at the load the measurement actually met.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from phalanx.measure.load import host_busy_s, others_busy_cores
from phalanx.measure.mlp import build_bench_model
from phalanx.measure.procs import run_fresh
from phalanx.data import split_batch
from phalanx.runtime.devices import parse_devices
from phalanx.runtime.launch import LaunchSpec, launch
from phalanx.data_parallel import prepare
from phalanx.train.loop import train_batch
from phalanx.runtime.world import World


@dataclass(frozen=True, kw_only=True)
class MeasureJob:
    model: str
    global_batch_size: int
    world_size: int
    threads_per_device: int
    algorithm: str
    bucket_cap_mb: float | None
    warmup_steps: int
    steps: int
    lr: float
    seed: int


@dataclass(frozen=True, kw_only=True)
class Measurement:
    images_per_s: float
    others_busy_cores: float  # cores other programs kept busy meanwhile (profile.others_busy_cores)


def _phalanx_worker(world: World, job: MeasureJob) -> dict:
    torch.manual_seed(job.seed)
    generator = torch.Generator().manual_seed(job.seed)  # every rank draws the same global batch
    X = torch.randn(job.global_batch_size, 1, 28, 28, generator=generator)
    y = torch.randint(0, 10, (job.global_batch_size,), generator=generator)
    X, y = (t.contiguous() for t in split_batch(X, y, world.world_size)[world.rank])
    with prepare(build_bench_model(job.model), world=world, algorithm=job.algorithm,
                 bucket_cap_mb=job.bucket_cap_mb) as dp:
        optimizer = torch.optim.SGD(dp.module.parameters(), lr=job.lr)
        for _ in range(job.warmup_steps):
            train_batch(dp, optimizer, X, y, global_batch_size=job.global_batch_size)
        if world.distributed:
            dist.barrier()  # every rank starts the clock together
        start_s, cpu0, host0 = time.perf_counter(), time.process_time(), host_busy_s()
        for _ in range(job.steps):
            train_batch(dp, optimizer, X, y, global_batch_size=job.global_batch_size)
        elapsed_s = time.perf_counter() - start_s
        host = None if host0 is None or world.rank != 0 else host_busy_s() - host0
        return {"wall_s": elapsed_s, "cpu_s": time.process_time() - cpu0, "host_busy_s": host}


def _single(*, rank: int, num_procs: int, port: int, job: MeasureJob) -> dict:
    # One device runs in the launcher's own process; this fresh process stands in for it.
    spec = LaunchSpec(plan=parse_devices("cpu:1", cuda_count=0), threads_per_device=job.threads_per_device)
    return launch(_phalanx_worker, job, spec=spec)[0]


def measure_phalanx(job: MeasureJob, *, timeout_s: float, deadline_s: float) -> Measurement:
    """Images/s of phalanx on `job.world_size` CPU devices (the slowest rank's time counts)."""
    if job.world_size == 1:
        by_rank = run_fresh(_single, job, num_procs=1, threads=job.threads_per_device, tune_allocator=True,
                            deadline_s=deadline_s, name="predict-validate")
    else:
        spec = LaunchSpec(plan=parse_devices(f"cpu:{job.world_size}", cuda_count=0),
                          threads_per_device=job.threads_per_device, timeout_s=timeout_s, deadline_s=deadline_s)
        by_rank = launch(_phalanx_worker, job, spec=spec)
    return Measurement(images_per_s=job.global_batch_size * job.steps / max(r["wall_s"] for r in by_rank),
                       others_busy_cores=others_busy_cores(by_rank))
