"""Replicas' normalization statistics kept identical: averaged across ranks after every synced step.

Data parallelism keeps parameters identical by summing gradients, but a plain BatchNorm (or
InstanceNorm with `track_running_stats`) layer also *updates buffers in forward* from the data
it sees: each replica's running mean and variance follow its own shards and drift apart (issue
22: running_var 1.8% apart between two ranks, and an evaluation that mixed the replicas). torch
DDP broadcasts rank 0's buffers before every forward (`broadcast_buffers=True`): replicas agree,
but their statistics are those of rank 0's shards alone. `RunningStats` *averages* them instead,
in one allreduce on the gradient exchange's own transport right after the gradients (so no
collective before forward, and on one host it is the shared-memory allreduce, tens of µs):

- running_mean is an exponential average, linear in the batch means, so the mean over ranks of
  the per-rank averages is the average of the global batch means - for equal shards exactly the
  1-device running_mean; broadcasting would keep one shard's sample of it.
- running_var becomes the mean of the per-rank variances, which leaves out the spread between
  the ranks' means (timm's `distribute_bn(reduce=True)` and `phalanx train --batchnorm local`'s
  epoch-end average make the same choice); `--batchnorm sync` is the exact alternative.
- averaging every synced step equals averaging once before evaluation (the averages are
  linear), but the replicas are then identical at *every* point a user might read them.

Summed in float64, so float32 statistics that already agree come back bitwise unchanged.
Layers that are already identical on every rank (phalanx's SyncBatchNorm) are left out; a model
without running statistics gets no `RunningStats` at all, so LeNet's step is unchanged. Other
buffers are broadcast once at construction and covered by the replica check (checks.py).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from phalanx.comm import allreduce_native
from phalanx.data_parallel.sync_batchnorm import SyncBatchNorm
from phalanx.runtime.world import World


def drifting_norm_layers(module: nn.Module) -> list[nn.Module]:
    """The layers whose running statistics follow each rank's own data: norm layers that track
    them and do not synchronise (phalanx's SyncBatchNorm computes them from the global batch)."""
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._NormBase)
            and not isinstance(m, SyncBatchNorm) and m.track_running_stats and m.running_mean is not None]


class RunningStats:
    """The drifting layers' running statistics, packed into one float64 tensor per exchange."""

    def __init__(self, layers: list[nn.Module]) -> None:
        floats = [t for m in layers for t in (m.running_mean, m.running_var)]
        counts = [m.num_batches_tracked for m in layers if m.num_batches_tracked is not None]
        self.tensors = floats + counts
        self.num_layers = len(layers)
        sizes = [t.numel() for t in self.tensors]
        self._flat = torch.zeros(sum(sizes), dtype=torch.float64, device=floats[0].device)
        self._views = [piece.view(t.shape) for piece, t in zip(torch.split(self._flat, sizes), self.tensors)]
        self._counts = self._flat[sum(sizes[: len(floats)]):]  # the integer counts, packed last

    @torch.no_grad()
    def average(self, allreduce: Callable[[torch.Tensor], object], world_size: int) -> None:
        """Make every rank's statistics the mean over ranks: pack, `allreduce` (a sum), unpack.
        Every rank computes the same quotient of the same sum, so the results are bitwise equal."""
        torch._foreach_copy_(self._views, self.tensors)
        allreduce(self._flat)
        self._flat.div_(world_size)
        self._counts.round_()  # num_batches_tracked: the rounded mean count (equal counts stay as they are)
        torch._foreach_copy_(self.tensors, self._views)


def running_stats_of(module: nn.Module) -> RunningStats | None:
    """A `RunningStats` for `module`'s drifting layers, or None when it has none."""
    layers = drifting_norm_layers(module)
    return RunningStats(layers) if layers else None


def average_running_stats(module: nn.Module, *, world: World) -> int:
    """Average `module`'s drifting running statistics across ranks once, now, with the backend's
    allreduce (what `DataParallel` does after every synced step, for a module outside one);
    return how many layers were averaged."""
    stats = running_stats_of(module)
    if stats is not None and world.distributed:
        stats.average(lambda flat: allreduce_native(flat, world=world), world.world_size)
    return 0 if stats is None else stats.num_layers
