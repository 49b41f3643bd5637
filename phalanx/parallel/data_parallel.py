"""Data parallelism as in D2L 13.5: every rank holds a full replica and sums gradients.

`DataParallel` owns the replica's synchronisation contract, the one torch DDP established:
rank 0's parameters and buffers are broadcast at construction so replicas start identical;
gradients live in flat buckets (see buckets.py) that are summed across ranks with the chosen
allreduce algorithm; `no_sync()` skips the exchange for gradient accumulation. Averaging is
done by the caller through the loss scale (sum over the shard / global batch size), which keeps
the update exactly the 1-device update even when the last batch splits unevenly across ranks.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from phalanx.comm import allreduce, broadcast_
from phalanx.parallel.buckets import Bucket, build_buckets, grads_are_bucket_views
from phalanx.world import World


class DataParallel:
    def __init__(
        self,
        module: nn.Module,
        *,
        world: World,
        algorithm: str = "native",
        bucket_cap_mb: float | None = None,
    ) -> None:
        self.world = world
        self.algorithm = algorithm
        self.module = module.to(world.device)
        self.broadcast_state(src=0)
        cap_bytes = None if bucket_cap_mb is None else int(bucket_cap_mb * 1024 * 1024)
        self.buckets: list[Bucket] = build_buckets(list(self.module.parameters()), cap_bytes=cap_bytes)
        self._sync_enabled = True

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def broadcast_state(self, *, src: int = 0) -> None:
        """Make every replica equal to rank `src`'s parameters and buffers (one flat broadcast)."""
        if not self.world.distributed:
            return
        tensors = [t for t in list(self.module.parameters()) + list(self.module.buffers())]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in tensors:
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        with torch.no_grad():
            for group in by_dtype.values():
                flat = torch.cat([t.detach().reshape(-1) for t in group])
                broadcast_(flat, world=self.world, src=src)
                offset = 0
                for tensor in group:
                    tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()

    def zero_grad(self) -> None:
        """Zero the bucket buffers (never set .grad to None: the views must survive)."""
        for bucket in self.buckets:
            bucket.buffer.zero_()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the previous setting is restored even on error."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    @property
    def sync_enabled(self) -> bool:
        return self._sync_enabled

    def allreduce_gradients(self) -> None:
        """Sum every bucket across ranks (in bucket order, identical on all ranks)."""
        if not self._sync_enabled or not self.world.distributed:
            return
        if not grads_are_bucket_views(self.buckets):
            raise RuntimeError(
                "a parameter's .grad no longer aliases its gradient bucket; "
                "use DataParallel.zero_grad() instead of optimizer.zero_grad(set_to_none=True)"
            )
        for bucket in self.buckets:
            allreduce(bucket.buffer, world=self.world, algorithm=self.algorithm)
