"""The reference allreduce: the backend's own `all_reduce` (gloo on CPU, NCCL on CUDA).

Every hand-written algorithm in `phalanx.comm` is tested against this one, and it is the
default for training: gloo and NCCL choose ring/tree/halving-doubling internally by size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from phalanx.world import World


def allreduce_native(flat: torch.Tensor, *, world: World, group: dist.ProcessGroup | None = None) -> None:
    """Sum `flat` in place across `group` (default: the whole world) with `dist.all_reduce`."""
    if not world.distributed:
        return
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
