"""The training loop, read top to bottom: `train_batch` is one lockstep step, `train_epoch` one pass.

Loss scaling is where data parallelism is exact or subtly wrong. Each rank computes the *sum* of
its shard's losses divided by the *global* batch size, so after the gradients are summed across
ranks the update is the 1-device update on the whole global batch - also for an uneven last
batch, where averaging per-rank means would weight the small shards too heavily.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from phalanx.comm import all_reduce_sum_
from phalanx.data import global_batches, rank_shard, to_float
from phalanx.parallel import DataParallel
from phalanx.world import World


@dataclass(frozen=True, kw_only=True)
class EpochStats:
    train_loss: float  # mean over every training example of the epoch, all ranks
    train_acc: float
    num_examples: int
    elapsed_s: float


def train_batch(
    dp: DataParallel,
    optimizer: torch.optim.Optimizer,
    X: torch.Tensor,
    y: torch.Tensor,
    *,
    global_batch_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step on this rank's shard (X, y); returns this shard's (loss sum, correct count)."""
    dp.zero_grad()
    if X.shape[0] > 0:
        logits = dp(X)
        loss_sum = F.cross_entropy(logits, y, reduction="sum")
        (loss_sum / global_batch_size).backward()
        correct = (logits.argmax(dim=1) == y).sum()
    else:
        # A rank can get an empty shard of a tiny last batch; it still joins the allreduce.
        loss_sum = torch.zeros((), device=X.device)
        correct = torch.zeros((), dtype=torch.long, device=X.device)
    dp.allreduce_gradients()
    optimizer.step()
    return loss_sum.detach(), correct


def train_epoch(
    dp: DataParallel,
    optimizer: torch.optim.Optimizer,
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    world: World,
    global_batch_size: int,
    seed: int,
    epoch: int,
    on_step: Callable[[int, int], None] | None = None,
) -> EpochStats:
    """One pass over (images, labels): same permutation on every rank, each reads its shard."""
    start_s = time.perf_counter()
    batches = global_batches(images.shape[0], global_batch_size, seed=seed, epoch=epoch)
    totals = torch.zeros(3, dtype=torch.float64, device=world.device)  # loss sum, correct, count
    dtype = next(dp.module.parameters()).dtype
    for step, batch in enumerate(batches):
        shard = rank_shard(batch, rank=world.rank, world_size=world.world_size).to(images.device)
        X = to_float(images[shard]).to(dtype)
        y = labels[shard]
        loss_sum, correct = train_batch(dp, optimizer, X, y, global_batch_size=batch.numel())
        totals[0] += loss_sum
        totals[1] += correct
        totals[2] += shard.numel()
        if on_step is not None:
            on_step(step + 1, len(batches))
    all_reduce_sum_(totals, world=world)  # one collective per epoch for the metrics
    if world.device.type == "cuda":
        torch.cuda.synchronize(world.device)
    elapsed_s = time.perf_counter() - start_s
    count = int(totals[2].item())
    return EpochStats(
        train_loss=totals[0].item() / count,
        train_acc=totals[1].item() / count,
        num_examples=count,
        elapsed_s=elapsed_s,
    )
