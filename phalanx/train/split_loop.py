"""One epoch and one evaluation of a model-parallel split (`--split layers|channels`).

The data-parallel loop (loop.py) gives each rank its shard of a global batch; here every rank
reads the *whole* global batch (the pipeline's first stage its images, its last stage its labels;
every channel shard both), since each device computes part of the model for all of it. The
same permutation per (seed, epoch), the same loss rule (sum / global batch size), the same
optimizer step, the same resume by skipping steps: only the step itself differs. Loss, correct
and example counts are summed on the ranks that hold the output and reduced once per epoch.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from phalanx.comm import all_reduce_sum_
from phalanx.data import global_batches, to_float
from phalanx.parallel.model_split import ModelSplit
from phalanx.train.loop import EpochStats
from phalanx.world import World


def train_split_batch(split: ModelSplit, optimizer: torch.optim.Optimizer, X: torch.Tensor, y: torch.Tensor,
                      *, global_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One step: forward and backward through the split, then each device updates its own parameters."""
    split.zero_grad()
    loss_sum, correct = split.train_batch(X, y, global_batch_size=global_batch_size)
    optimizer.step()
    return loss_sum, correct


def train_split_epoch(
    split: ModelSplit, optimizer: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor, *,
    world: World, global_batch_size: int, seed: int, epoch: int, start_step: int = 0,
    start_totals: Sequence[float] = (), after_step: Callable | None = None,
    on_step: Callable[[int, int], None] | None = None,
) -> EpochStats:
    """One pass over (images, labels); the arguments mean what they mean for `loop.train_epoch`."""
    earlier_s = float(start_totals[3]) if len(start_totals) == 4 else 0.0
    start_s = time.perf_counter() - earlier_s
    batches = global_batches(images.shape[0], global_batch_size, seed=seed, epoch=epoch)
    totals = torch.zeros(3, dtype=torch.float64, device=world.device)  # loss sum, correct, count
    if len(start_totals) == 4:
        totals += torch.tensor(list(start_totals[:3]), dtype=torch.float64, device=world.device)
    dtype = next(split.module.parameters()).dtype
    for step, batch in enumerate(batches):
        if step < start_step:
            continue
        batch = batch.to(images.device)
        X, y = to_float(images[batch]).to(dtype), labels[batch]
        loss_sum, correct = train_split_batch(split, optimizer, X, y, global_batch_size=batch.numel())
        totals[0] += loss_sum
        totals[1] += correct
        totals[2] += batch.numel() if split.holds_output else 0
        if after_step is not None:
            after_step(step + 1, len(batches), loss_sum, lambda: [*totals.tolist(), time.perf_counter() - start_s])
        if on_step is not None:
            on_step(step + 1, len(batches))
    all_reduce_sum_(totals, world=world)
    if world.device.type == "cuda":
        torch.cuda.synchronize(world.device)
    elapsed_s = time.perf_counter() - start_s
    count = max(1, int(totals[2].item()))
    return EpochStats(train_loss=totals[0].item() / count, train_acc=totals[1].item() / count, num_examples=count,
                      elapsed_s=elapsed_s)


def evaluate_split(split: ModelSplit, images: torch.Tensor, labels: torch.Tensor, *, world: World,
                   batch_size: int = 1024) -> float:
    """Test accuracy: every rank runs every test batch through its part; output holders count."""
    was_training = split.module.training
    split.module.eval()
    counts = torch.zeros(2, dtype=torch.float64, device=world.device)  # correct, seen
    dtype = next(split.module.parameters()).dtype
    for lo in range(0, images.shape[0], batch_size):
        hi = min(lo + batch_size, images.shape[0])
        logits = split.predict(to_float(images[lo:hi]).to(dtype))
        if logits is not None:
            counts[0] += (logits.argmax(dim=1) == labels[lo:hi]).sum()
            counts[1] += hi - lo
    split.module.train(was_training)
    all_reduce_sum_(counts, world=world)
    seen = int(counts[1].item())
    if seen != images.shape[0]:  # every test image must be counted by exactly one rank
        raise RuntimeError(f"evaluation saw {seen} test images, expected {images.shape[0]}")
    return counts[0].item() / max(seen, 1)
