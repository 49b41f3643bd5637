"""The tail every resume-across-sharding test shares: a replica's whole state, and a checkpoint
resumed into a fresh replica, trained on and compared with the uninterrupted run's state."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

import phalanx


def whole_state(dp) -> dict[str, torch.Tensor]:
    """The replica's whole state dict (gathered where sharded), detached copies."""
    state = dp.full_state_dict() if dp.sharding is not None else dp.state_dict()
    return {k: v.detach().clone() for k, v in state.items()}


def resumed_relative_error(world, where: Path, replica: Callable[[], tuple], train_on: Callable[[object, object], None],
                           reference: dict[str, torch.Tensor], *, saved_at: int,
                           global_batch_size: int) -> tuple[float, str | None]:
    """Resume `where` into `replica()`'s (dp, optimizer), `train_on(dp, optimizer)` to the end, and
    return the largest relative difference from `reference` over floating tensors, or (nan, the
    refusal's words) where resume refused."""
    dp, optimizer = replica()
    try:
        position = phalanx.resume(where, world=world, model=dp, optimizer=optimizer,
                                  global_batch_size=global_batch_size, seed=0)
    except phalanx.UsageError as exc:
        dp.close()
        return float("nan"), str(exc)
    assert position.step == saved_at
    train_on(dp, optimizer)
    resumed = whole_state(dp)
    dp.close()
    assert set(resumed) == set(reference)
    return max(float((resumed[k] - reference[k]).norm() / reference[k].norm().clamp_min(1e-30))
               for k in reference if reference[k].is_floating_point()), None
