"""Sharded data parallelism (ZeRO stages 1-3): what each rank keeps, and how it stays exact.

`shard="optimizer"` (stage 1), `"gradients"` (2) and `"parameters"` (3) keep on each rank only
its share - one contiguous range of the flat order (flat_layout.py) - of, respectively, the
optimizer state; that and the summed gradients; all of that and the parameters at rest
(Rajbhandari et al. 2020, "ZeRO"). The update stays the 1-device update: gradients are still
summed over every rank, only each rank's sum covers its own range, and an element-wise optimizer
(optim.py) updates that range as it would update the whole. Per bucket, as backward
fills it, the exchange is a reduce-scatter instead of an allreduce (a ring allreduce's first
half); the updated ranges are all-gathered back after the optimizer step (stages 1, 2) or just
before each layer runs (stage 3) - params.py and gather_hooks.py.

- Stage 1: gradients as unsharded, views into each bucket's gradient buffer; the bucket's
  reduce-scatter runs in place, so this rank's range of it is its summed shard gradient.
- Stages 2 and 3: when a bucket launches (`fill`) the gradients autograd made are copied into
  its buffer and dropped - or, for a bucket of one parameter (a large layer), sent as they are,
  with no copy; what holds the bucket lives until the reduce-scatter is waited, which copies
  this rank's range into the persistent shard gradient. At most `MAX_IN_FLIGHT` buckets are
  alive at once (overlap.py waits the oldest first).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from phalanx.comm import AsyncComm, Tag
from phalanx.data_parallel.buckets import Bucket, grad_view
from phalanx.data_parallel.carry import CarriedSum
from phalanx.data_parallel.sharding.flat_layout import (FlatLayout, Slot, free_storage, memory_order, parameter_names,
                                               refill_storage)
from phalanx.data_parallel.sharding.gather_hooks import GatherHooks
from phalanx.data_parallel.sharding.optim import WholeOptimizerGuard
from phalanx.data_parallel.sharding.params import ShardedParameters
from phalanx.runtime.binding import give_back_freed_memory

SHARD_STAGES = ("none", "optimizer", "gradients", "parameters")
# Stages 2 and 3: buckets whose whole gradient buffer may be alive at once (launched, not yet
# waited); a launch beyond it waits the oldest first. Two keeps one in flight while the next fills.
MAX_IN_FLIGHT = 2


@dataclass(frozen=True, kw_only=True)
class OwnedPiece:
    """This rank's part of one parameter: elements [start, stop) of `slot` in memory order."""

    values: torch.Tensor  # 1-D view of this rank's parameter shard
    grad: torch.Tensor  # 1-D view of this rank's summed gradient
    slot: Slot
    start: int
    stop: int


class ShardedHandle:
    """A bucket's pending reduce-scatter; `wait()` also copies this rank's summed range into its
    shard gradient (widened from the wire dtype; `add`: adds it, stages 2 and 3, divided by `divide_by`
    under `average=True`) and, in stages 2 and 3, frees the bucket."""

    def __init__(self, handle, wire: torch.Tensor, owned: tuple[int, int], shard_grad: torch.Tensor | None,
                 release: Callable[[], None] | None, *, add: bool = False, divide_by: int | None = None) -> None:
        self._handle, self._wire, self._owned = handle, wire, owned
        self._shard_grad, self._release, self._add, self._divide_by = shard_grad, release, add, divide_by
        self._waited = False

    @property
    def waited(self) -> bool:
        return self._waited

    def wait(self) -> None:
        self._handle.wait()
        lo, hi = self._owned
        if self._shard_grad is not None and hi > lo:
            with torch.no_grad():
                if self._add and self._divide_by is not None:  # average=True: a carried g_old stays whole
                    # widened first: a compressed wire's sum is divided in the gradient's dtype, as before
                    self._shard_grad.add_(self._wire[lo:hi].to(self._shard_grad.dtype) / self._divide_by)
                elif self._add:
                    self._shard_grad.add_(self._wire[lo:hi])
                else:
                    self._shard_grad.copy_(self._wire[lo:hi])
        if self._release is not None:
            self._release()
        # Drop every reference to the whole bucket now: the scheduler keeps this handle until the
        # step's end, and a gradient sent as it is would live that long otherwise.
        self._handle = self._wire = None
        self._waited = True


class Sharding:
    """A replica's sharded state and its collectives, built by DataParallel over its buckets for
    a sharded `stage` (its options checked the name). `comm`/`algorithm` carry the
    reduce-scatters and all-gathers, tagged like the allreduces; `steps()` is the replica's
    synced steps so far (the step in a gather's tag)."""

    def __init__(self, *, stage: str, module: nn.Module, buckets: Sequence[Bucket], rank: int, world_size: int,
                 comm: AsyncComm, algorithm: str, steps: Callable[[], int]) -> None:
        self.stage, self.buckets = stage, list(buckets)
        self._comm, self._algorithm = comm, algorithm
        self.keeps_gradients = stage == "optimizer"
        self.keeps_parameters = stage != "parameters"
        self.layout = FlatLayout(self.buckets, names=parameter_names(module), world_size=world_size)
        if not self.keeps_gradients:  # gradients stop being bucket views (autograd makes its own): freed first
            for bucket in self.buckets:
                for param in bucket.params:
                    param.grad = None
                free_storage(bucket.buffer)
        self.params = ShardedParameters(self.buckets, layout=self.layout, rank=rank, keep_whole=self.keeps_parameters,
                                        comm=comm, algorithm=algorithm, steps=steps)
        self.owned = self.params.owned
        if self.keeps_gradients:
            self.shard_grads = [b.buffer[lo:hi] for b, (lo, hi) in zip(self.buckets, self.owned)]
        else:
            self.shard_grads = [torch.zeros(hi - lo, dtype=b.buffer.dtype, device=b.buffer.device)
                                for b, (lo, hi) in zip(self.buckets, self.owned)]
        self._hooks = None if self.keeps_parameters else GatherHooks(module, self.params)
        self.optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # dp.optimizer's records
        self._guard = WholeOptimizerGuard(module, stage)  # AdamW(dp.parameters()): refused in one line
        self._divide_by: int | None = None  # average=True at stages 2 and 3: each sum divided as added (adopt)
        give_back_freed_memory()  # what set-up freed (whole parameters, gradient buckets) leaves the process

    def adopt(self, carry: CarriedSum, *, divide_by: int | None) -> int | None:
        """A sum carried without zero_grad kept once (carry.py), `divide_by` the world size under
        `average=True`; returns what the replica divides after the exchange. Stage 1: each rank keeps
        its own range; the replica divides. Stages 2 and 3 divide each reduce-scatter as they add it
        into the shard gradient, so a carried g_old is not divided again: the replica divides nothing."""
        if self.keeps_gradients:
            carry.keep(self.owned)
            return divide_by
        self._divide_by = divide_by
        return None

    def fill(self, bucket: Bucket) -> torch.Tensor:
        """The flat gradient `bucket` sends, as it launches. Stage 1: its buffer. Stages 2 and 3:
        a bucket of one parameter sends the gradient autograd made, in place (no copy: a large
        layer's gradient exists once, as under FSDP); a bucket of several, its buffer allocated
        now and holding their gradients. Either way the parameters' `.grad` is dropped, and in
        stage 3 the bucket's parameters are freed too, this backward being done with them."""
        if self.keeps_gradients:
            return bucket.buffer
        whole = self.params.views[bucket.index]
        grads = [param.grad for param in bucket.params]
        for param in bucket.params:
            param.grad = None
        self.params.release(bucket.index)
        if len(grads) == 1 and grads[0] is not None and grads[0].layout == torch.strided and \
                grads[0].stride() == whole[0].stride() and grads[0].dtype == bucket.buffer.dtype:
            return memory_order(grads[0].detach())
        refill_storage(bucket.buffer)
        with torch.no_grad():
            bucket.buffer.zero_()
            for grad, offset, view in zip(grads, bucket.offsets, whole):
                if grad is not None and grad.layout != torch.strided:  # a sparse embedding's: summed dense
                    grad_view(bucket.buffer, offset, view).add_(grad)
                elif grad is not None:
                    grad_view(bucket.buffer, offset, view).copy_(grad)
        return bucket.buffer

    def reduce_scatter(self, bucket: Bucket, sent: torch.Tensor, wire: torch.Tensor, *, tag: Tag,
                       on_done: Callable[[], None] | None = None) -> ShardedHandle:
        """Start the reduce-scatter of `wire` (`sent`, the flat gradient `fill` gave, or a
        compressed copy of it): once waited, this rank's range of the sum is in its shard
        gradient, and what held the whole bucket is freed (stages 2, 3)."""
        index = bucket.index
        handle = self._comm.reduce_scatter_async(wire, counts=self.params.counts[index], algorithm=self._algorithm,
                                                 tag=tag, on_done=on_done)
        in_place = self.keeps_gradients and wire is bucket.buffer  # stage 1: the range is the shard already
        release = None if self.keeps_gradients or sent is not bucket.buffer else \
            (lambda buffer=bucket.buffer: free_storage(buffer))  # a gradient of its own goes with its last reference
        # Stages 2 and 3 add the sum into the shard gradient, which only zero_grad zeroes: a gradient
        # carried into the next step without zero_grad is in it once, as on one device (carry.py).
        return ShardedHandle(handle, wire, self.owned[index], None if in_place else self.shard_grads[index], release,
                             add=not self.keeps_gradients, divide_by=self._divide_by)

    def zero_grad(self) -> None:
        """Stages 2 and 3 (stage 1 zeroes its buckets): drop gradients autograd left on the
        parameters (a backward that never synced) and zero the shard gradients."""
        for bucket in self.buckets:
            for param in bucket.params:
                param.grad = None
        for grad in self.shard_grads:
            grad.zero_()

    def gather_after_step(self) -> None:
        """After the optimizer step: the updated ranges back into every replica (stages 1, 2)."""
        self.params.gather_after_step()

    def whole(self):
        """A block in which every parameter is whole (a collective under stage 3)."""
        return self.params.whole()

    def load_state_dict(self, module: nn.Module, state, *, strict: bool):
        return self.params.load_state_dict(module, state, strict=strict)

    def named_gradients(self) -> dict[str, torch.Tensor]:
        """This rank's summed gradient, by bucket (the finite-gradient guard reads it)."""
        return {f"gradient bucket {b.index} (this rank's shard)": grad
                for b, grad in zip(self.buckets, self.shard_grads) if grad.numel()}

    def piece(self, param: nn.Parameter) -> OwnedPiece | None:
        """This rank's part of `param` (values and summed gradient as 1-D views in memory order,
        and where it lies), or None when other ranks own all of it."""
        for bucket, (lo, hi) in zip(self.buckets, self.owned):
            for member, offset, whole in zip(bucket.params, bucket.offsets, self.params.views[bucket.index]):
                if member is param:  # (whole: under stage 3 the parameter itself is empty at rest)
                    start, stop = max(lo, offset), min(hi, offset + whole.numel())
                    if stop <= start:
                        return None
                    values, grads = self.params.shard[bucket.index], self.shard_grads[bucket.index]
                    slot = next(s for s in self.layout.slots if s.bucket == bucket.index and s.bucket_offset == offset)
                    return OwnedPiece(values=values[start - lo:stop - lo], grad=grads[start - lo:stop - lo], slot=slot,
                                      start=start - offset, stop=stop - offset)
        raise ValueError("the optimizer was given a parameter that is not the replica's; pass the model's own "
                         "parameters (or param groups of them)")

    def leave_whole(self) -> None:
        """Stage 3, as the replica closes: every parameter gathered whole and left so, a plain parameter
        again (a collective); stages 1 and 2 keep them whole throughout."""
        for index in range(len(self.buckets)):
            self.params.ensure_gathered(index)

    def close(self) -> None:
        if self._hooks is not None:
            self._hooks.close()
        self._guard.close()
        self._comm = None
