"""The learning rate of each optimizer step: constant, or a linear warmup into it.

Goyal et al. (2017, "Accurate, Large Minibatch SGD") pair the linear-scaling rule (lr grows with
the global batch) with a gradual warmup: the lr climbs linearly from lr / warmup_steps to lr
over the first warmup steps, so the large early gradients do not throw a large-batch run off
course. `lr_at(step)` is a pure function of the global step, so a resumed run picks up the
schedule exactly where the interrupted one was.
"""

from __future__ import annotations

import math

import torch


def warmup_steps(warmup_epochs: float, steps_per_epoch: int) -> int:
    """Optimizer steps of warmup for a fraction (or multiple) of epochs; 0: no warmup."""
    return math.ceil(warmup_epochs * steps_per_epoch) if warmup_epochs > 0 else 0


def lr_at(step: int, *, base_lr: float, warmup: int) -> float:
    """The lr of global optimizer step `step` (0-based): base_lr * (step + 1) / warmup, capped."""
    if warmup <= 0 or step >= warmup:
        return base_lr
    return base_lr * (step + 1) / warmup


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
