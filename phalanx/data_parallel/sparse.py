"""Sparse gradients (`nn.Embedding(..., sparse=True)`): summed dense, handed back sparse, as on one device.

On one device an embedding built with `sparse=True` gets a sparse COO gradient: only the rows the
batch looked up. What the optimizer does depends on that layout: SGD keeps a sparse momentum
buffer, Adagrad and SparseAdam update the state of the rows present (and only those; SparseAdam
refuses a dense gradient), `clip_grad_norm_` refuses it. The replica sums such a gradient dense
in its bucket (autograd adds a sparse gradient into the dense slot, and a slot set to None takes
it back dense, usage.py), which is exact; then `SparseGradients` makes it sparse again, so k
devices step the optimizer, save its state and resume it as one device does.

Its rows are the union of the rows any rank's backward touched since the gradient was last zeroed,
not the rows whose sum is nonzero: a row two ranks pushed in opposite directions is present with a
zero value, as on one device (where SparseAdam and Adagrad update its state all the same). Each
rank notes the rows of every sparse gradient that arrives (a tensor hook sees it before it is
added into the slot) in a 0/1 mask, one float per row, and one flag per parameter for a dense
contribution (a tied output projection's): one device then holds a dense gradient, and so does
the replica. After the buckets' sum one allreduce adds the masks and flags up (one collective per
step, on every rank whether or not it touched the table, even with an empty shard). The rows of a
gradient come back in order, once each: coalesced, where one device's is not yet (the optimizers
coalesce it first; the values agree to rounding). The gradient is its bucket slot again at the
next `dp.zero_grad()`; `optimizer.zero_grad()` sets it to None, and the next landing takes it back.

Which parameters: the weights of `nn.Embedding` and `nn.EmbeddingBag` layers with `sparse=True`
when the buckets are laid out, the same on every rank. A sparse gradient from elsewhere
(`F.embedding(..., sparse=True)` on a weight of one's own) stays dense, summed exactly. Under
`shard=` the optimizer steps this rank's dense range of the sum (sharding/), and nothing here applies.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from phalanx.data_parallel.buckets import Bucket, grad_view
from phalanx.data_parallel.replica_hook import ReplicaHook


class SparseGradients:
    """The sparse-gradient parameters `params` of a bucket layout: each one's touched rows and dense
    flag (one flat float32 tensor, so one allreduce sums them), and its bucket slot."""

    def __init__(self, params: Sequence[nn.Parameter], buckets: Sequence[Bucket]) -> None:
        slots = {id(p): (b, offset) for b in buckets for p, offset in zip(b.params, b.offsets)}
        self.params = list(params)
        self._views = [grad_view(slots[id(p)][0].buffer, slots[id(p)][1], p) for p in self.params]
        rows = [p.shape[0] for p in self.params]
        # Counts of ranks up to 2**24 are exact in float32, and every transport sums it.
        self.flat = torch.zeros(sum(rows) + len(rows), dtype=torch.float32, device=self.params[0].device)
        self._touched = list(torch.split(self.flat[:sum(rows)], rows))
        self._dense = self.flat[sum(rows):]

    def hooks(self) -> list:
        """Register the tensor hooks that note each arriving gradient's rows; returns their handles."""
        return [param.register_hook(ReplicaHook(self._arrived, index)) for index, param in enumerate(self.params)]

    @torch.no_grad()
    def _arrived(self, index: int, grad: torch.Tensor) -> None:
        """Before autograd adds `grad` into parameter `index`'s `.grad`: its rows, or its density."""
        if self.params[index].grad is None:  # set to None since (optimizer.zero_grad()): its rows start over
            self._forget(index)
        if grad.layout == torch.sparse_coo and grad.sparse_dim() == 1:
            self._touched[index][grad._indices()[0]] = 1.0
        else:
            self._dense[index] = 1.0

    def _forget(self, index: int) -> None:
        self._touched[index].zero_()
        self._dense[index] = 0.0

    def zeroed(self) -> None:
        """The replica's zero_grad: each gradient its (zeroed) bucket slot again, no row touched."""
        self.slots_again()
        self.flat.zero_()

    def slots_again(self) -> None:
        """Each sparse gradient its bucket slot again, the rows noted kept (carry.py: a rank that zeroed its slots)."""
        for param, view in zip(self.params, self._views):
            if param.grad is not None and param.grad.layout != torch.strided:
                param.grad = view

    def before_sum(self) -> None:
        """Before a sync: a gradient set to None since, and not landed again, touched no row here."""
        for index, param in enumerate(self.params):
            if param.grad is None:
                self._forget(index)

    def adopt(self, before: SparseGradients | None) -> None:
        """Laid out again inside a step: the rows noted under the old layout carry over."""
        for index, param in enumerate(self.params if before is not None else ()):
            old = next((i for i, p in enumerate(before.params) if p is param), None)
            if old is not None:
                self._touched[index].copy_(before._touched[old])
                self._dense[index] = before._dense[old]

    @torch.no_grad()
    def after_sum(self, allreduce: Callable[[torch.Tensor], object]) -> None:
        """After the buckets' sum (and any averaging): the masks summed, and each gradient that
        arrived sparse on every rank that touched it sparse again, over the union of their rows."""
        allreduce(self.flat)
        self.flat.clamp_(max=1.0)  # the union, kept until zeroed: a later backward's rows join it
        for param, touched, dense in zip(self.params, self._touched, self._dense.tolist()):
            if param.grad is None or dense > 0:  # no rank used it (usage.py), or one device's is dense
                continue
            rows = touched.nonzero().reshape(1, -1)
            param.grad = torch.sparse_coo_tensor(rows, param.grad[rows[0]], param.shape, is_coalesced=True,
                                                 check_invariants=False)  # sorted, unique: built so


def sparse_gradients(module: nn.Module, buckets: Sequence[Bucket]) -> SparseGradients | None:
    """`SparseGradients` over `module`'s trainable sparse embeddings that `buckets` hold, or None."""
    held = {id(p) for b in buckets for p in b.params}
    params = {id(layer.weight): layer.weight for layer in module.modules()
              if isinstance(layer, (nn.Embedding, nn.EmbeddingBag)) and layer.sparse and id(layer.weight) in held}
    return SparseGradients(list(params.values()), buckets) if params else None
