"""Profile one device: forward, backward and optimizer time, when each gradient bucket is ready.

The step profiled is phalanx's own (DataParallel with its buckets and gradient hooks, the
steps of train_batch) in a world of one, so nothing is exchanged: zero_grad, forward, backward,
finish_gradient_sync, SGD. A post-accumulate-grad hook per parameter - the event phalanx's overlap
launches buckets from - stamps when each gradient lands; a bucket is ready when its last one has.

A device is profiled as it will run at k: with its exchange where training puts it (buckets and
hooks where it overlaps backward, one flat bucket where overlap auto turns it off: phase_for),
with its share of the batch (the largest shard, ceil(B/k): the slowest rank sets the pace) and,
when the k devices are processes sharing this host (loopback), with the thread count each worker
gets (cores // k, at least 1) *and* with as many copies running at the same time as it will
have, up to twice the cores - co-running processes slow each other down (memory bandwidth,
caches: ~18% for two LeNet workers), and time-sliced ones more than the arithmetic share
(context switches; with only as many copies as cores the k = 3 prediction on 2 cores read +26%,
with all three -2%), which a lone process would not show. Beyond twice the cores the
time-slicing is arithmetic (timeline.py), from the cores other programs kept busy meanwhile
(/proc/stat's busy time minus the profile's own CPU time): a shared machine's other load decides
how much k processes can take. The profile runs in fresh processes with phalanx's worker set-up
(allocator setting, channels_last, synthetic in-memory batch, as `bench scaling`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from phalanx.measure.load import busy_window, others_busy_cores
from phalanx.measure.mlp import build_bench_model
from phalanx.measure.procs import run_fresh
from phalanx.data import shard_sizes
from phalanx.data_parallel import DataParallel, DataParallelConfig, prepare_replica
from phalanx.data_parallel.config import auto_overlap
from phalanx.predict.timeline import DeviceProfile
from phalanx.runtime.world import World


OVERSUBSCRIBE_PROFILED = 2  # profile up to this many processes per core as they will run


@dataclass(frozen=True, kw_only=True)
class Phase:
    """One setting to profile: `co_runners` processes each run the step at once, with the
    exchange beside backward (`overlap`, buckets) or after it (one flat bucket)."""

    batch_size_per_device: int
    threads: int
    co_runners: int
    overlap: bool = True

    def __post_init__(self) -> None:
        if min(self.batch_size_per_device, self.threads, self.co_runners) < 1:
            raise ValueError(f"batch, threads and co-runners must be >= 1, got {self}")


@dataclass(frozen=True, kw_only=True)
class ProfileJob:
    model: str
    global_batch_size: int  # the loss is scaled by it, as in training (cost is the same either way)
    phases: tuple[Phase, ...]
    bucket_cap_mb: float | None
    warmup_steps: int
    steps: int
    lr: float
    seed: int


def phase_for(world_size: int, global_batch_size: int, cores: int, *, shares_host: bool, algorithm: str,
              overlap: bool | None = None) -> Phase:
    """How one of `world_size` devices runs: its shard, its threads, how many run beside it, and
    whether its exchange overlaps backward (`overlap`; None: what training's auto picks for k
    workers of these threads on these cores, data_parallel/config.py's auto_overlap)."""
    batch = shard_sizes(global_batch_size, world_size)[0]  # the largest shard of split_batch
    threads = max(1, cores // world_size) if shares_host else cores
    if overlap is None:
        overlap, _ = auto_overlap(algorithm=algorithm, workers=world_size if shares_host else 1, threads=threads,
                                  cores=cores)
    if not shares_host:
        return Phase(batch_size_per_device=batch, threads=threads, co_runners=1, overlap=overlap)
    # Up to twice the cores, run all k copies: past the cores, time-slicing k lockstep processes
    # costs more than the arithmetic share (context switches, caches); beyond that, arithmetic.
    return Phase(batch_size_per_device=batch, threads=threads, overlap=overlap,
                 co_runners=max(1, min(world_size, OVERSUBSCRIBE_PROFILED * cores // threads)))


def _replica(job: ProfileJob, phase: Phase) -> DataParallel:
    world = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
                  backend="none", timeout_s=60.0)  # a device alone: DataParallel exchanges nothing
    # exchange_alone keeps the buckets and hooks a world of one otherwise leaves out: the step
    # profiled is the one each of k > 1 devices runs (its allreduces return at once here).
    options = DataParallelConfig(bucket_cap_mb=job.bucket_cap_mb, exchange_alone=True, overlap=phase.overlap)
    return prepare_replica(build_bench_model(job.model), options, world=world)


class _StepClock:
    """Runs train_batch's steps with a timestamp between each, and one per gradient landing."""

    def __init__(self, dp: DataParallel, job: ProfileJob, batch: int) -> None:
        generator = torch.Generator().manual_seed(job.seed)
        self.X = torch.randn(batch, 1, 28, 28, generator=generator)
        self.y = torch.randint(0, 10, (batch,), generator=generator)
        self.dp, self.job = dp, job
        self.optimizer = torch.optim.SGD(dp.module.parameters(), lr=job.lr)
        self.landed: dict[int, float] = {}
        self._bucket_params = [[id(p) for p in bucket.params] for bucket in dp.buckets]
        self._hooks = [p.register_post_accumulate_grad_hook(self._stamp)
                       for bucket in dp.buckets for p in bucket.params]

    def _stamp(self, param: torch.nn.Parameter) -> None:
        self.landed[id(param)] = time.perf_counter()

    def step(self) -> dict[str, object]:
        self.landed.clear()
        t0 = time.perf_counter()
        self.dp.zero_grad()
        t1 = time.perf_counter()
        loss_sum = F.cross_entropy(self.dp(self.X), self.y, reduction="sum")
        t2 = time.perf_counter()
        (loss_sum / self.job.global_batch_size).backward()
        t3 = time.perf_counter()
        self.dp.finish_gradient_sync()
        t4 = time.perf_counter()
        self.optimizer.step()
        t5 = time.perf_counter()
        ready = [max(self.landed.get(i, t3) for i in ids) - t2 for ids in self._bucket_params]
        return {"forward_s": t2 - t1, "backward_s": t3 - t2, "optimizer_s": t5 - t4,
                "other_s": (t1 - t0) + (t4 - t3), "step_s": t5 - t0, "ready_s": ready}

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


def _profile_worker(*, rank: int, num_procs: int, port: int, job: ProfileJob) -> list[dict]:
    """Every phase in turn; ranks >= a phase's co_runners sit it out. Barriers bracket the timing."""
    if num_procs > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_procs)
    barrier = dist.barrier if num_procs > 1 else (lambda: None)
    torch.manual_seed(job.seed)
    results: list[dict] = []
    for phase in job.phases:
        active = rank < phase.co_runners
        clock = None
        barrier()
        if active:
            torch.set_num_threads(phase.threads)
            dp = _replica(job, phase)
            clock = _StepClock(dp, job, phase.batch_size_per_device)
            for _ in range(job.warmup_steps):
                clock.step()
        barrier()  # co-runners time their steps together
        # Every rank (idle ones too) notes its own CPU time and the host's over the same window.
        with busy_window() as window:
            records = [clock.step() for _ in range(job.steps)] if clock is not None else []
            barrier()
        if clock is not None:
            clock.close()
            clock.dp.close()
        results.append({"records": records, "window": window,
                        "bucket_bytes": [] if clock is None else [b.sent_bytes for b in clock.dp.buckets]})
    return results


def summarize(phase: Phase, per_rank: list[dict]) -> DeviceProfile:
    """Medians of the co-runners' pooled records (all of them: every copy is one device)."""
    windows = [rank["window"] for rank in per_rank]
    per_rank = [rank for rank in per_rank if rank["records"]]
    records = [r for rank in per_rank for r in rank["records"]]

    def median(key: str) -> float:
        return statistics.median(r[key] for r in records)

    num_buckets = len(per_rank[0]["bucket_bytes"])
    return DeviceProfile(
        batch_size_per_device=phase.batch_size_per_device, threads=phase.threads, co_runners=phase.co_runners,
        overlapped=phase.overlap, forward_s=median("forward_s"), backward_s=median("backward_s"),
        optimizer_s=median("optimizer_s"), other_s=median("other_s"),
        step_samples_s=tuple(r["step_s"] for r in records),
        bucket_ready_s=tuple(statistics.median(r["ready_s"][i] for r in records) for i in range(num_buckets)),
        bucket_bytes=tuple(per_rank[0]["bucket_bytes"]), others_busy_cores=others_busy_cores(windows))


def profile_devices(job: ProfileJob, *, deadline_s: float) -> dict[Phase, DeviceProfile]:
    """Run every phase of `job` in fresh processes; one DeviceProfile per phase."""
    num_procs = max(phase.co_runners for phase in job.phases)
    by_rank = run_fresh(_profile_worker, job, num_procs=num_procs, threads=1, tune_allocator=True,
                        deadline_s=deadline_s, name="predict-profile")
    return {phase: summarize(phase, [rank[i] for rank in by_rank]) for i, phase in enumerate(job.phases)}
