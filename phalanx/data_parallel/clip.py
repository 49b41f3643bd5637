"""Gradient clipping by the global norm, done where data parallelism makes it right.

The norm to clip by is that of the gradient the 1-device run would have: the *summed* gradient.
Before the exchange a rank holds only its shard's part, whose norm is neither the global norm nor
the same on every rank (clipping there makes replicas diverge, or silently changes the maths).
After `finish_gradient_sync()` every rank holds the same summed gradient in its buckets, so the
norm computed locally is the global one, identical on every rank, and costs no communication.
"""

from __future__ import annotations

import torch

from phalanx.data_parallel.data_parallel import DataParallel


def clip_grad_norm_(dp: DataParallel, max_norm: float, *, norm_type: float = 2.0) -> torch.Tensor:
    """Scale the summed gradients so their global `norm_type` norm is at most `max_norm`.

    Call after `dp.finish_gradient_sync()` and before `optimizer.step()`; returns the norm before
    clipping (as torch's `clip_grad_norm_`, which does the arithmetic). Refused inside `no_sync()`,
    where gradients are still partial.
    """
    if not dp.sync_enabled:
        raise RuntimeError("clip_grad_norm_ inside no_sync(): each rank holds only its partial gradient; "
                           "clip after the synced backward's finish_gradient_sync()")
    if dp.exchange_in_flight:
        raise RuntimeError("clip_grad_norm_ while gradient allreduces are in flight; call "
                           "dp.finish_gradient_sync() first, so the norm is the summed gradient's")
    return torch.nn.utils.clip_grad_norm_(dp.module.parameters(), max_norm, norm_type=norm_type)
