"""One device, the whole data set resident on it: phalanx's step against the plain PyTorch loop.

The worker behind `bench step` (host time per step on any device) and `bench gpu` (images/s on
one GPU). Every contender trains the same model on the same resident data - `num_images`
random uint8 images and labels on the device, a fresh permutation each epoch - for
`warmup_epochs` untimed and `epochs` timed epochs, in a fresh process of its own:

- `phalanx`: what `phalanx train` runs per step on one device - `prepare`, the data split,
  `train_epoch` with the job's per-step hook - set up by `phalanx.runtime.launch` as
  `phalanx train --devices 1` is; with `graphs`, its step captured (`captured_train_step`);
- `plain`: the loop PyTorch's tutorials write (`zero_grad(set_to_none=True)`,
  `X[idx].float() / 255`, forward, mean cross-entropy, backward, `step()`), with the same
  process set-up (threads, allocator); with `graphs`, its whole step captured as one CUDA graph
  through a static index buffer, warmed up on a side stream as PyTorch's recipe does (the
  epoch's smaller last batch is dropped, as that recipe's loops do);
- `ddp`: the plain loop through torch DDP in a world of one (NCCL on a GPU, gloo on the CPU).

Options every contender takes alike: a fused SGD (`fused=True`), channels_last, a bfloat16
autocast forward, `torch.compile` of the model (phalanx compiles before `prepare`, as its docs
say). Each timed epoch reports its wall time and the main thread's CPU time (`host_s`: on the
CPU, the step's whole cost; on a GPU, the time the host spent issuing it, plus any wait).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.nn.functional as F

from phalanx.data import global_batches
from phalanx.data_parallel import prepare
from phalanx.data_parallel.strategy import DataSplit
from phalanx.job.config import TrainConfig
from phalanx.job.step_hook import after_step_hook
from phalanx.measure.procs import run_fresh
from phalanx.measure.timing import run_interleaved
from phalanx.models import MODELS, build_model
from phalanx.runtime.devices import parse_devices
from phalanx.runtime.launch import LaunchSpec, launch
from phalanx.runtime.world import World
from phalanx.train.graphs import CudaGraph
from phalanx.train.loop import captured_train_step, train_epoch

KINDS = ("phalanx", "plain", "ddp")


@dataclass(frozen=True, kw_only=True)
class OneDeviceJob:
    """One contender's run: picklable, handed to its fresh process."""

    kind: str  # one of KINDS
    device: str  # "cpu" or "cuda"
    model: str = "lenet"
    num_images: int = 60_000
    global_batch_size: int = 256
    warmup_epochs: int = 1
    epochs: int = 2
    threads: int = 1  # CPU intra-op threads
    lr: float = 0.2
    seed: int = 0
    graphs: bool = False  # phalanx: --cuda-graphs on; plain: the captured loop
    fused: bool = False  # SGD(fused=True)
    channels_last: bool = False
    bf16: bool = False  # forward under a bfloat16 autocast
    compile: bool = False  # torch.compile(model)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind {self.kind!r} is unknown; choose one of {', '.join(KINDS)}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device {self.device!r} is unknown; choose cpu or cuda")
        if self.model not in MODELS:
            raise ValueError(f"model {self.model!r} is unknown; choose one of {', '.join(MODELS)}")
        if self.graphs and self.device != "cuda":
            raise ValueError("a captured step needs a CUDA device")
        if self.global_batch_size > self.num_images:
            raise ValueError(f"batch {self.global_batch_size} is larger than the {self.num_images} images")


def resident_data(job: OneDeviceJob, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`num_images` random 28x28 uint8 images and their labels, on `device` (the same for every contender)."""
    generator = torch.Generator().manual_seed(job.seed)
    images = torch.randint(0, 256, (job.num_images, 1, 28, 28), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, 10, (job.num_images,), generator=generator)
    return images.to(device), labels.to(device)


def _model(job: OneDeviceJob) -> torch.nn.Module:
    torch.manual_seed(job.seed)
    model = build_model(job.model)
    return torch.compile(model) if job.compile else model


def _sgd_options(job: OneDeviceJob) -> dict[str, Any]:
    return {"lr": job.lr, "fused": True} if job.fused else {"lr": job.lr}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_epochs(run_epoch: Callable[[int], int], job: OneDeviceJob, device: torch.device) -> dict[str, list[float]]:
    """Warm-up epochs, then each timed epoch's wall and main-thread CPU seconds and images trained."""
    for epoch in range(job.warmup_epochs):
        run_epoch(epoch)
    record: dict[str, list[float]] = {"wall_s": [], "host_s": [], "images": []}
    for epoch in range(job.warmup_epochs, job.warmup_epochs + job.epochs):
        _synchronize(device)
        start_s, host0 = time.perf_counter(), time.thread_time()
        images = run_epoch(epoch)
        _synchronize(device)
        record["wall_s"].append(time.perf_counter() - start_s)
        record["host_s"].append(time.thread_time() - host0)
        record["images"].append(images)
    return record


def _phalanx_worker(world: World, job: OneDeviceJob) -> dict[str, Any]:
    dp = prepare(_model(job), world=world, memory_format="channels_last" if job.channels_last else "contiguous",
                 precision="bf16-mixed" if job.bf16 else None)
    strategy = DataSplit(dp)
    optimizer = strategy.make_optimizer(torch.optim.SGD, **_sgd_options(job))
    images, labels = resident_data(job, world.device)
    notes: list[str] = []
    graph = captured_train_step(strategy, optimizer, images, labels, global_batch_size=job.global_batch_size,
                                backend=CudaGraph(world.device), say=notes.append) if job.graphs else None
    config = TrainConfig(global_batch_size=job.global_batch_size, seed=job.seed)

    def run_epoch(epoch: int) -> int:
        hook = after_step_hook(config=config, world=world, optimizer=optimizer, epoch=epoch, warmup=0,
                               gradients=strategy.named_gradients, save=lambda position: None,
                               check_replicas=strategy.check_replicas)
        return train_epoch(strategy, optimizer, images, labels, world=world, global_batch_size=job.global_batch_size,
                           seed=job.seed, epoch=epoch, after_step=hook, graph=graph).num_examples

    try:
        record = timed_epochs(run_epoch, job, world.device)
    finally:
        dp.close()
    return {**record, "graph": None if graph is None else graph.state, "notes": notes}


def _phalanx_fresh(*, rank: int, num_procs: int, port: int, job: OneDeviceJob) -> dict[str, Any]:
    # One device runs in the launcher's own process, as `phalanx train --devices 1` does.
    spec = LaunchSpec(plan=parse_devices("cuda:0" if job.device == "cuda" else "cpu:1"), threads_per_device=job.threads)
    return launch(_phalanx_worker, job, spec=spec)[0]


def _plain_epochs(model: torch.nn.Module, job: OneDeviceJob, device: torch.device) -> dict[str, Any]:
    """The plain loop (captured as one CUDA graph with job.graphs), timed."""
    if job.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), **_sgd_options(job))
    images, labels = resident_data(job, device)
    batch = job.global_batch_size

    def forward():  # autocast's cache would outlive a captured step: off
        return (torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False) if job.bf16
                else contextlib.nullcontext())

    def step(index: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        X = images[index].float() / 255
        with forward():
            loss = F.cross_entropy(model(X), labels[index])
        loss.backward()
        optimizer.step()

    static = torch.zeros(batch, dtype=torch.long, device=device)
    graph = _captured(lambda: step(static), device) if job.graphs else None

    def run_epoch(epoch: int) -> int:
        order = torch.cat(global_batches(job.num_images, batch, seed=job.seed, epoch=epoch)).to(device)
        if graph is None:
            for first in range(0, job.num_images, batch):
                step(order[first:first + batch])
            return job.num_images
        for first in range(0, job.num_images - batch + 1, batch):  # the smaller last batch is dropped
            static.copy_(order[first:first + batch])
            graph.replay()
        return job.num_images // batch * batch

    # The record's keys are phalanx's (bench gpu reads "graph" and "notes" of every contender): torch's
    # capture either replays or raised above.
    return {**timed_epochs(run_epoch, job, device), "graph": None if graph is None else "replaying", "notes": []}


def _captured(step: Callable[[], None], device: torch.device) -> torch.cuda.CUDAGraph:
    """PyTorch's whole-network capture: 3 warm-up steps on a side stream, then the capture."""
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def _device(job: OneDeviceJob) -> torch.device:
    return torch.device("cuda", 0) if job.device == "cuda" else torch.device("cpu")


def _plain_fresh(*, rank: int, num_procs: int, port: int, job: OneDeviceJob) -> dict[str, Any]:
    device = _device(job)
    return _plain_epochs(_model(job).to(device), job, device)


def _ddp_fresh(*, rank: int, num_procs: int, port: int, job: OneDeviceJob) -> dict[str, Any]:
    import torch.distributed as dist

    device = _device(job)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)
    try:
        model = _model(job).to(device)
        if job.channels_last:  # before wrapping: DDP lays its buckets out once
            model = model.to(memory_format=torch.channels_last)
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        return _plain_epochs(model, replace(job, channels_last=False), device)
    finally:
        dist.destroy_process_group()


def run_one_device(job: OneDeviceJob, *, deadline_s: float) -> dict[str, Any]:
    """Run `job` in a fresh process; its record (per timed epoch: wall_s, host_s, images)."""
    fn = {"phalanx": _phalanx_fresh, "plain": _plain_fresh, "ddp": _ddp_fresh}[job.kind]
    # phalanx's worker sets its own allocator and threads (launch); the others get the same.
    return run_fresh(fn, job, num_procs=1, threads=job.threads, tune_allocator=job.kind != "phalanx",
                     deadline_s=deadline_s, name=f"{job.kind}-{job.device}")[0]




def run_contenders(jobs: dict[str, OneDeviceJob], *, rounds: int, deadline_s: float,
                   on_run: Callable[[str], None] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Every contender once per round, interleaved, each in a fresh process; the records by name."""
    started = [0]

    def runner(name: str, job: OneDeviceJob) -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            started[0] += 1
            if on_run is not None:
                on_run(f"[{started[0]}/{rounds * len(jobs)}] {name}")
            return run_one_device(job, deadline_s=deadline_s)
        return run

    return run_interleaved({name: runner(name, job) for name, job in jobs.items()}, rounds=rounds, warmup_rounds=0)


__all__ = ["KINDS", "OneDeviceJob", "resident_data", "run_contenders", "run_one_device", "timed_epochs"]
