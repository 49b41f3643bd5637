"""What a synced step does once the gradients are summed, for the habits DDP users bring.

`DataParallel.finish_gradient_sync()` sums every bucket; `StepExtras.after_exchange` then does
what the replica was built to do beyond the sum, in this order:

1. `average=True`: divide the sum by the world size - DDP's mean of per-rank means, for a loss
   that is a per-rank mean (exact only when every rank's shard is equally large; phalanx's own
   rule, `shard_loss`, is exact for any split).
2. Plain BatchNorm running statistics, averaged across ranks (running_stats.py), so the
   replicas stay one model; plain BatchNorm layers under the `sync` policy (a replica built
   without prepare, which converts them) get a one-line notice naming the choices at construction.
3. Rank 0's one-time look at the first synced step (first_step.py): a loss that bypassed
   `shard_loss`, a shard's own size given to it, a padding DistributedSampler; and, on every
   rank at synced steps 1, 2, 4, 8, ..., the sizes shard_loss got compared across the ranks
   (one small sum each, sizes.py).

Each part exists only where it applies: LeNet under `phalanx.prepare` has no running statistics
and, after its first step, no check but the sizes' small sum at power-of-two steps.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from phalanx.errors import warn_at_caller
from phalanx.data_parallel.guards.first_step import FirstStepCheck, caller_frame
from phalanx.data_parallel.guards.sizes import SizesAcrossRanks
from phalanx.data_parallel.guards.running_stats import running_stats_of
from phalanx.data_parallel.sync_batchnorm import has_plain_batchnorm
from phalanx.runtime.world import World


class StepExtras:
    """The after-the-sum parts of one replica's synced step; see the module docstring. `average`,
    `average_running_stats` and `batchnorm` (the policy: sync or local) are the replica's options,
    checked where they were made (config.py)."""

    def __init__(self, module: nn.Module, *, world: World, average: bool | None, average_running_stats: bool,
                 batchnorm: str) -> None:
        self.world = world
        self.divide_by = world.world_size if average and world.distributed else None
        self.running_stats = running_stats_of(module) if average_running_stats and world.distributed else None
        unapplied = batchnorm == "sync" and has_plain_batchnorm(module)  # layers no one made SyncBatchNorm
        if self.running_stats is not None and unapplied and world.is_main:
            warn_at_caller(batchnorm_notice(self.running_stats.num_layers, world.world_size))
        # Rank 0 looks at the first synced step; the other ranks would find the same and stay quiet.
        self.first_step = FirstStepCheck(list(module.parameters()), world_size=world.world_size,
                                         check_loss=average is None, module=module) \
            if world.distributed and world.is_main else None
        self.sizes = SizesAcrossRanks(module, world_size=world.world_size) \
            if world.distributed and average is None else None

    def after_exchange(self, gradients: Sequence[torch.Tensor], allreduce: Callable[[torch.Tensor], object]) -> None:
        """Called once per synced step, after the summed `gradients` (the buckets, or a sharded
        replica's shard of them) hold the sum; `allreduce` sums a tensor in place on the
        exchange's own transport. Frames: the user's loop is 3 levels up."""
        if self.divide_by is not None:
            torch._foreach_div_(list(gradients), float(self.divide_by))
        if self.running_stats is not None:
            self.running_stats.average(allreduce, self.world.world_size)
        if self.first_step is not None and self.first_step.after_sync(caller_frame(2)):
            self.first_step = None
        if self.sizes is not None:  # every rank; a collective at synced steps 1, 2, 4, 8, ...
            messages, going_on = self.sizes.after_step(allreduce, rank=self.world.rank, device=self.world.device)
            if not going_on:
                self.sizes = None
            for message in messages if self.world.is_main else ():  # every rank reached the same verdict
                warn_at_caller(message)

    def close(self) -> None:
        if self.sizes is not None:
            self.sizes.close()
            self.sizes = None
        if self.first_step is not None:
            self.first_step.close()
            self.first_step = None


def batchnorm_notice(num_layers: int, world_size: int) -> str:
    return (f"{num_layers} BatchNorm layer(s) normalize with each of the {world_size} devices' own shard (policy "
            "local; their running statistics are averaged across ranks after every step); for the whole global "
            "batch's statistics build the replica with phalanx.prepare(model, world=world, batchnorm=\"sync\"), "
            "or pass batchnorm=\"local\" to keep this and silence the notice")
