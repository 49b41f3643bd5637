"""Measure the loopback link on this machine: α and β of one allreduce algorithm, and η.

One spawned 2-process run (the production launcher: gloo over 127.0.0.1, one thread per worker,
as a 2-device run has on two cores). (1) An allreduce sweep over message sizes with the chosen
algorithm, timed by `bench allreduce`'s method (phalanx/measure/collective.py: warm-up,
calibrated batches, interleaved rounds, the slowest rank's time); `costmodel.fit_link` turns the
medians into α and β. (2) η, the
share of communication that hides behind computation here. Measuring it as "compute + comm -
both together" failed on this shared 2-core machine: a few ms of difference drowned in other
programs' load. What decides it is steadier: on this host no copy engine moves the bytes, gloo's
threads (or AsyncComm's) do, on the cores the workers compute on; every CPU second the
communication takes while the cores are computing comes out of backward. So the model's own
buckets are allreduced asynchronously (as training launches them) in repeated trials, and each
rank's process CPU time over the trial's wall time gives the communication's share of a core;
η = 1 - that share (median of trials, mean of ranks), clipped to [0, 1].
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from phalanx.comm import AsyncComm
from phalanx.measure.collective import time_collectives
from phalanx.measure.timing import slowest_per_round
from phalanx.predict.costmodel import LinkFit, fit_link
from phalanx.runtime.devices import parse_devices
from phalanx.runtime.launch import LaunchSpec, launch
from phalanx.runtime.world import World

DEFAULT_SWEEP_BYTES = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)


@dataclass(frozen=True, kw_only=True)
class LinkJob:
    algorithm: str
    sizes_bytes: tuple[int, ...]
    bucket_bytes: tuple[int, ...]  # the model's buckets, for η
    rounds: int = 5
    warmup_calls: int = 2
    overlap_trials: int = 15


@dataclass(frozen=True, kw_only=True)
class LinkMeasurement:
    fit: LinkFit
    sizes_bytes: tuple[int, ...]
    times_s: tuple[float, ...]  # median per size, slowest rank
    overlap_efficiency: float
    comm_cpu_share: float  # CPU seconds per second of the buckets' allreduces, per rank (median, mean of ranks)


def _link_worker(world: World, job: LinkJob) -> dict:
    # One comm for the sweep and the overlap trials: it owns shm's segment or the p2p group.
    comm = AsyncComm(world=world, algorithms=(job.algorithm,))
    try:
        return _measure(world, job, comm)
    finally:
        comm.close()


def _measure(world: World, job: LinkJob, comm: AsyncComm) -> dict:
    buffers = {size: torch.zeros(size // 4) for size in job.sizes_bytes}
    sweep = time_collectives({size: (lambda b=buffer: comm.allreduce(b, algorithm=job.algorithm))
                              for size, buffer in buffers.items()},
                             rounds=job.rounds, warmup_calls=job.warmup_calls)["samples"]

    buckets = [torch.zeros(max(1, n // 4)) for n in job.bucket_bytes]

    def communicate() -> None:
        for handle in [comm.allreduce_async(b, algorithm=job.algorithm) for b in buckets]:
            handle.wait()
    for _ in range(job.warmup_calls):
        communicate()
    cpu_share = []
    for _ in range(job.overlap_trials):
        dist.barrier()
        wall0, cpu0 = time.perf_counter(), time.process_time()  # process time: every thread's
        communicate()
        cpu_share.append((time.process_time() - cpu0) / (time.perf_counter() - wall0))
    return {"sweep": sweep, "cpu_share": statistics.median(cpu_share)}


def overlap_efficiency(cpu_share: float) -> float:
    """η = 1 - the share of a core the communication keeps busy while it runs, clipped to [0, 1]."""
    return min(1.0, max(0.0, 1.0 - cpu_share))


def sweep_sizes(bucket_bytes: tuple[int, ...]) -> tuple[int, ...]:
    """The standard sweep plus the model's own bucket sizes (whole float32s): the fit is anchored
    where the prediction will use it."""
    return tuple(sorted(set(DEFAULT_SWEEP_BYTES) | {max(4, n // 4 * 4) for n in bucket_bytes}))


def measure_link(job: LinkJob, *, timeout_s: float, deadline_s: float) -> LinkMeasurement:
    """Spawn 2 workers, sweep and overlap-test; fit α, β for `job.algorithm` at k = 2."""
    spec = LaunchSpec(plan=parse_devices("cpu:2", cuda_count=0), threads_per_device=1, timeout_s=timeout_s,
                      deadline_s=deadline_s)
    by_rank = launch(_link_worker, job, spec=spec)
    times = []
    for size in job.sizes_bytes:  # per round the slower rank's time, then the median of rounds
        times.append(statistics.median(slowest_per_round([rank["sweep"][size] for rank in by_rank])))
    fit = fit_link(job.algorithm, job.sizes_bytes, times, world_size=2)
    cpu_share = statistics.fmean(rank["cpu_share"] for rank in by_rank)
    return LinkMeasurement(fit=fit, sizes_bytes=tuple(job.sizes_bytes), times_s=tuple(times),
                           overlap_efficiency=overlap_efficiency(cpu_share), comm_cpu_share=cpu_share)
