"""Test accuracy computed on all devices at once (the chapter's exercise 4).

The test set is cut into contiguous shards, one per rank (sizes differ by at most one); each rank
counts its correct predictions and the counts are summed, so every test image is counted exactly
once and every rank gets the same accuracy.
"""

from __future__ import annotations

import torch
from torch import nn

from phalanx.comm import all_reduce_sum_
from phalanx.data import shard_bounds, to_float
from phalanx.world import World


def evaluate(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, *, world: World, batch_size: int = 1024
) -> float:
    start, stop = shard_bounds(images.shape[0], world.world_size, world.rank)
    was_training = model.training
    model.eval()
    counts = torch.zeros(2, dtype=torch.float64, device=world.device)  # correct, seen
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        for lo in range(start, stop, batch_size):
            hi = min(lo + batch_size, stop)
            logits = model(to_float(images[lo:hi]).to(dtype))
            counts[0] += (logits.argmax(dim=1) == labels[lo:hi]).sum()
            counts[1] += hi - lo
    model.train(was_training)
    all_reduce_sum_(counts, world=world)
    seen = int(counts[1].item())
    if seen != images.shape[0]:  # a sharding bug would silently skew accuracy
        raise RuntimeError(f"evaluation saw {seen} test images, expected {images.shape[0]}")
    return counts[0].item() / max(seen, 1)
