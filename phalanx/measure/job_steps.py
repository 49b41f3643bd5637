"""What one measured job is, and the step each contender takes on it: the pieces bench scaling's
fresh-process workers (step.py) and its side-by-side starts (side_by_side.py) build alike.

A `StepJob` is a model, a global batch, the steps to time and the settings of phalanx's replica;
every rank draws the same fixed random global batch from the job's seed and takes its
`split_batch` shard (`shard_batch`), so data time is zero for every contender. `prepare_replica`
and `phalanx_step` are phalanx's (`prepare`, `train_batch`); `plain_step` is the PyTorch step the
ceilings, DDP and single processes take (`build_model`: the job's model in its memory format;
`plain_optimizer`: its optimizer), the lockstep ceiling's meeting after backward its
`lockstep_meeting`; `world_barrier` is where every rank starts the clock together. Both steps
take a `clock` (phases.py's PhaseClock: forward, backward, wait, optimizer) that sums each phase's
seconds on this rank; the side-by-side starts pass one, fresh-process workers none.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from phalanx.comm import open_comm
from phalanx.data import split_batch
from phalanx.data_parallel import apply_memory_format, prepare, resolve_memory_format
from phalanx.data_parallel.guards.finite import DEFAULT_CHECK_FINITE_EVERY
from phalanx.measure.mlp import build_bench_model
from phalanx.measure.phases import PhaseClock
from phalanx.runtime.world import World
from phalanx.telemetry.tracing import span
from phalanx.train.loop import train_batch

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}


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
    bucket_cap_mb: float | str | None = "auto"  # prepare's: by the allreduce
    check_finite_every: int = DEFAULT_CHECK_FINITE_EVERY
    shard: str = "none"
    overlap: bool | None = None  # the exchange beside backward (None: auto, DataParallelConfig's)
    optimizer: str = "sgd"  # a key of OPTIMIZERS

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r} is unknown; choose one of {', '.join(OPTIMIZERS)}")


def build_model(job: StepJob) -> torch.nn.Module:
    model = build_bench_model(job.model)
    return apply_memory_format(model, resolve_memory_format(job.memory_format, model, torch.device("cpu")))


def shard_batch(job: StepJob, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(job.seed)  # every rank draws the same global batch
    X = torch.randn(job.global_batch_size, 1, 28, 28, generator=generator)
    y = torch.randint(0, 10, (job.global_batch_size,), generator=generator)
    X_shard, y_shard = split_batch(X, y, job.num_shards)[rank]
    return X_shard.contiguous(), y_shard.contiguous()


def prepare_replica(job: StepJob, world: World):
    """The job's model as phalanx's replica (`prepare`) with the job's settings; BatchNorm "local":
    each rank's own batch statistics, as DDP's and FSDP's BatchNorm computes them."""
    return prepare(build_bench_model(job.model), world=world, memory_format=job.memory_format, batchnorm="local",
                   grad_dtype=job.grad_dtype, algorithm=job.algorithm, bucket_cap_mb=job.bucket_cap_mb,
                   shard=job.shard, check_finite_every=job.check_finite_every, overlap=job.overlap)


def phalanx_step(dp, optimizer: torch.optim.Optimizer, job: StepJob, *, rank: int,
                 clock: PhaseClock | None = None) -> Callable[[], None]:
    """phalanx's training step (`train_batch`, as `phalanx train` runs it) on this rank's shard;
    `clock` sums its phases through the spans train_batch opens for a Tracer."""
    X, y = shard_batch(job, rank)

    def step() -> None:
        train_batch(dp, optimizer, X, y, global_batch_size=job.global_batch_size, tracer=clock)

    return step


def plain_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, job: StepJob, *, rank: int,
               mean_loss: bool, meet: Callable[[], object] | None = None,
               clock: PhaseClock | None = None) -> Callable[[], None]:
    """The plain PyTorch step on this rank's shard: the loss summed over the global batch
    (phalanx's scaling), or the mean over the shard (`mean_loss`: DDP's, FSDP's); `meet()`, if
    given, after backward (the lockstep ceiling's meeting, its "wait" phase); `clock` sums the
    phases under phalanx's step's names."""
    X, y = shard_batch(job, rank)
    scale = X.shape[0] if mean_loss else job.global_batch_size

    def step() -> None:
        optimizer.zero_grad()
        with span(clock, "forward"):
            loss = F.cross_entropy(model(X), y, reduction="sum") / scale
        with span(clock, "backward"):
            loss.backward()
        if meet is not None:
            with span(clock, "wait"):
                meet()
        with span(clock, "optimizer"):
            optimizer.step()

    return step


def plain_optimizer(params, job: StepJob) -> torch.optim.Optimizer:
    """The job's optimizer (OPTIMIZERS) over `params`, at its lr."""
    return OPTIMIZERS[job.optimizer](params, lr=job.lr)


def world_barrier(world: World) -> Callable[[], object]:
    """Every rank meets here (a world of one: nothing to meet)."""
    return dist.barrier if world.distributed else (lambda: None)


def lockstep_meeting(world: World, stack: contextlib.ExitStack, *, numel: int = 1) -> Callable[[], None]:
    """The lockstep ceiling's meeting, once a step after backward: an allreduce of `numel` float32
    zeros (4 bytes; as many as the gradient's for a twin that exchanges as much as phalanx) of
    the algorithm phalanx's auto picks, on a comm `stack` closes."""
    opened = open_comm(world, "auto")
    stack.callback(opened.comm.close)
    token = torch.zeros(numel)
    return lambda: opened.comm.allreduce(token, algorithm=opened.algorithm)
