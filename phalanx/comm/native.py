"""The reference allreduce: the backend's own `all_reduce` (gloo on CPU, NCCL on CUDA).

Every hand-written algorithm in `phalanx.comm` is tested against this one, and it is the
default for training: gloo and NCCL choose ring/tree/halving-doubling internally by size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from phalanx.comm.calls import native
from phalanx.runtime.tags import Tag
from phalanx.runtime.world import World


def allreduce_native(flat: torch.Tensor, *, world: World, group: dist.ProcessGroup | None = None,
                     tag: Tag = Tag()) -> None:
    """Sum `flat` in place across `group` (default: the whole world) with `dist.all_reduce`.

    On the default group the call is entered on the collective board as `tag` says and waited
    with the watchdog's deadline; a sub-group pairs its calls on its own, so its collectives stay
    off the board."""
    if not world.distributed:
        return
    if group is not None:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        return
    native(world, tag, lambda: dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True),
           size_bytes=flat.numel() * flat.element_size(), dtype=flat.dtype)
