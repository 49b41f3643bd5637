"""`phalanx train --devices auto` on a CPU host: how many workers, with how many threads each, train
this model fastest on this host, chosen from about a second of measurement per layout.

The layouts are k workers of t threads, k a power of two up to the cores or the cores themselves (a
layout must fit the global batch and the split), t what a run of k workers would get
(binding.worker_threads: --threads-per-device, or PLACEMENT on a k-th of the cores). Each is probed
in this process the way its workers would run: k threads (the first this one) start together, each
with its own replica, optimizer and a random batch of this model's input shape (the largest shard of
the global batch), each running ATen ops with an intra-op team of t (torch.set_num_threads in the
thread), so the k x t threads contend for the cores, caches and memory bandwidth as the workers
would, and under their allocator setting (binding.keep_freed_memory_mapped). One warm-up step, then
3 timed steps (1 when a step takes over 0.25 s); the layout's images/s is the global batch over the
slowest thread's step. So a layout costs about four of its steps plus set-up: for LeNet at batch 256
on 2 cores, whose step takes about 0.1 s on a quiet machine, under a second (on the shared, loaded
build machine 2-10 s). Layouts past PROBE_BUDGET_S of probing are left out (fewest workers are
probed first, and the first always runs), so a slow model or a busy host costs at most about that
plus one layout. The fastest wins, and among layouts within 3% of it the one with the fewest
workers: communication, start-up and memory grow with k, and the probe leaves them out.

What the probe does not see: the gradient exchange (the shm allreduce costs a few percent of a
LeNet step at k = 2), and Python's GIL, which serializes each thread's Python between ATen ops,
so many workers with tiny shards are undercounted. `phalanx predict` prices both, at a cost of
seconds per k in fresh processes; the probe is for choosing at the start of every run.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.data import ImageDataset
from phalanx.data_parallel.memory_format import apply_memory_format, resolve_memory_format
from phalanx.job.config import TrainConfig
from phalanx.models import build_model
from phalanx.runtime.binding import (available_cores, give_back_freed_memory, keep_freed_memory_mapped,
                                     set_intra_op_threads, worker_threads)

MARGIN = 0.03  # layouts this close to the fastest count as a tie, won by the fewest workers
LONG_STEP_S = 0.25  # a warm-up step longer than this: one timed step instead of three
PROBE_BUDGET_S = 8.0  # no layout is started after this much probing


@dataclass(frozen=True, kw_only=True)
class Layout:
    workers: int
    threads: int

    def __str__(self) -> str:
        return f"cpu:{self.workers} x {self.threads} thread{'s' * (self.threads > 1)}"


@dataclass(frozen=True, kw_only=True)
class Probe:
    layout: Layout
    images_per_s: float


def candidate_layouts(global_batch_size: int, *, cores: int, threads: int | None, bind_cores: bool,
                      fits: Callable[[int], bool] = lambda k: True) -> list[Layout]:
    """The layouts to probe, fewest workers first: k in 1, 2, 4, ... up to `cores`, and `cores`;
    each k no larger than the global batch and accepted by `fits` (the split's constraints)."""
    counts = sorted({k for k in (2 ** i for i in range(cores.bit_length())) if k <= cores} | {cores})
    return [Layout(workers=k, threads=worker_threads(k, bind_cores=bind_cores, threads=threads))
            for k in counts if k <= global_batch_size and fits(k)]


def choose(probes: list[Probe], *, margin: float = MARGIN) -> Layout:
    """The fastest layout; among those within `margin` of it, the one with the fewest workers."""
    best = max(p.images_per_s for p in probes)
    return min((p for p in probes if p.images_per_s >= best * (1 - margin)), key=lambda p: p.layout.workers).layout


def describe(chosen: Layout, probes: list[Probe], *, probe_s: float,
             skipped: tuple[Layout, ...] = ()) -> str:
    """The run's first line: what was chosen, and every layout's measured images/s, in probe order."""
    measured = ", ".join(f"{p.layout} {p.images_per_s:.0f}" for p in probes)
    left = f"; not probed (past {PROBE_BUDGET_S:g} s): {', '.join(map(str, skipped))}" if skipped else ""
    return (f"--devices auto: {chosen} (measured images/s over {probe_s:.1f} s: {measured}{left}; the fastest, "
            f"or the fewest workers within {MARGIN:.0%} of it)")


def probe_layout(model: nn.Module, input_shape: tuple[int, ...], *, global_batch_size: int, layout: Layout,
                 num_classes: int, seed: int = 0) -> float:
    """Images/s of `layout` on this host: k threads training copies of `model` at once (see the
    module docstring), the first of them this one, as a worker trains on its main thread (and
    its heap); this thread's intra-op count is kept. `model` is left untouched."""
    k, shard = layout.workers, -(-global_batch_size // layout.workers)
    start, warmed = threading.Barrier(k), threading.Barrier(k)
    warm_s, step_s, errors = [0.0] * k, [0.0] * k, []

    def worker(index: int) -> None:
        try:
            torch.set_num_threads(layout.threads)  # this thread's team, as a worker's training thread
            replica = copy.deepcopy(model)
            optimizer = torch.optim.SGD(replica.parameters(), lr=0.01)
            generator = torch.Generator().manual_seed(seed + index)
            x = torch.randn(shard, *input_shape, generator=generator, dtype=next(model.parameters()).dtype)
            if resolve_memory_format("auto", replica, torch.device("cpu")) is torch.channels_last and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            y = torch.randint(0, num_classes, (shard,), generator=generator)

            def step() -> None:
                optimizer.zero_grad(set_to_none=True)
                F.cross_entropy(replica(x), y).backward()
                optimizer.step()
            start.wait()
            began = time.perf_counter()
            step()
            warm_s[index] = time.perf_counter() - began
            warmed.wait()  # every warm-up timed: each thread takes the same number of timed steps
            steps = 1 if max(warm_s) > LONG_STEP_S else 3
            began = time.perf_counter()
            for _ in range(steps):
                step()
            step_s[index] = (time.perf_counter() - began) / steps
        except BaseException as exc:  # raised on this thread once all ended; the barriers broken for the others
            errors.append(exc)
            start.abort()
            warmed.abort()

    threads = [threading.Thread(target=worker, args=(i,), name=f"phalanx-probe-{i}", daemon=True)
               for i in range(1, k)]
    for thread in threads:
        thread.start()
    mine = torch.get_num_threads()
    try:
        worker(0)
    finally:
        for thread in threads:
            thread.join()
        torch.set_num_threads(mine)  # after every probe thread set its own (and with it torch's default)
    if errors:
        raise errors[0]
    return global_batch_size / max(step_s)


def probe_layouts(model: nn.Module, input_shape: tuple[int, ...], layouts: list[Layout], *, global_batch_size: int,
                  num_classes: int, budget_s: float = PROBE_BUDGET_S) -> tuple[list[Probe], float]:
    """The layouts' images/s, in order, until `budget_s` of probing has passed (the first layout
    always runs), and the seconds it took. This thread's own intra-op count is kept (probe_layout
    restores it). Probed under the workers' allocator
    setting (binding.keep_freed_memory_mapped; a user's MALLOC_* wins, in the workers too), the
    probe's memory returned to the system afterwards."""
    # torch's second pool made at one thread first, as in a worker (binding.py)
    set_intra_op_threads(torch.get_num_threads())
    # Without it every step's activations page-fault in again, and the threads of one team fault on
    # one process's memory map: on 2 cores 1 x 2 probed at 4,800-5,300 images/s against the 7,200
    # its run trains at (2 x 1 probed right, 7,100-7,900), and on 16 cores 1 x 16 at 17,642 against
    # 23,055, so auto took more workers than pay.
    keep_freed_memory_mapped()
    model = apply_memory_format(model, resolve_memory_format("auto", model, torch.device("cpu")))
    began, probes = time.perf_counter(), []
    try:
        for layout in layouts:
            if probes and time.perf_counter() - began > budget_s:
                break
            probes.append(Probe(layout=layout, images_per_s=probe_layout(
                model, input_shape, global_batch_size=global_batch_size, layout=layout, num_classes=num_classes)))
    finally:
        give_back_freed_memory()  # the probe's replicas and activations, kept on the heap by the setting
    return probes, time.perf_counter() - began


def auto_layout(model: nn.Module, input_shape: tuple[int, ...], *, global_batch_size: int, num_classes: int,
                threads: int | None, bind_cores: bool, fits: Callable[[int], bool]) -> tuple[Layout, str]:
    """The layout `--devices auto` runs on this CPU host, and the line that says why."""
    layouts = candidate_layouts(global_batch_size, cores=available_cores(), threads=threads, bind_cores=bind_cores,
                                fits=fits)
    probes, probe_s = probe_layouts(model, input_shape, layouts, global_batch_size=global_batch_size,
                                    num_classes=num_classes)
    chosen = choose(probes)
    return chosen, describe(chosen, probes, probe_s=probe_s, skipped=tuple(layouts[len(probes):]))


def resolve_auto(config: TrainConfig, data: ImageDataset) -> tuple[TrainConfig, str]:
    """`config` with --devices auto made cpu:k and its threads t for this host and model, and the
    line that says what was chosen from what."""
    def fits(k: int) -> bool:
        try:
            config.check_devices(k)
        except ValueError:
            return False
        return True

    model = build_model(config.model, init=config.init, num_classes=data.num_classes).to(getattr(torch, config.dtype))
    layout, line = auto_layout(model, tuple(data.train_images.shape[1:]), global_batch_size=config.global_batch_size,
                               num_classes=data.num_classes, threads=config.launch.threads_per_device,
                               bind_cores=config.launch.bind_cores, fits=fits)
    launch = replace(config.launch, devices=f"cpu:{layout.workers}", threads_per_device=layout.threads)
    return replace(config, launch=launch), line
