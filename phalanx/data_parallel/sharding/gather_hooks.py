"""Stage 3 (`shard="parameters"`): a layer's parameters gathered just before it runs, freed after.

At rest each rank holds only its range of the flat order (params.py); a bucket's
parameters are whole only while a layer that owns some of them computes. `GatherHooks` hooks
every module that owns parameters directly:

- **forward pre-hook**, the module's first (a pre-hook of the user's, prune's
  `weight_orig * weight_mask`, reads whole parameters): its buckets gathered (an all-gather each;
  a bucket an earlier layer gathered is whole already), and the all-gather of the bucket forward
  needs next started, so it runs on the communication thread while this layer computes (FSDP's
  forward prefetch);
- **forward hook**: once every module owning parameters of a bucket has run forward, the bucket
  is freed - except, while gradients are recorded, bucket 0 (the last layers: backward needs it
  first, so it stays whole rather than being gathered twice in a row); and on each output that
  records gradients, a hook that gathers the module's buckets again when backward reaches it
  (that gradient arrives before the module's backward runs, which reads the weights) and
  starts the next bucket's gather in backward's order;
- **after backward**: a bucket is freed once its gradients have all landed and its
  reduce-scatter launches (stages.py's `fill`).

So a step gathers most buckets twice (forward, backward) and holds at most the buckets in use:
FSDP's `reshard_after_forward=True`. Every gather is a collective that every rank must reach in
the same order, so every rank runs forward and backward at every step, even on an empty shard of
the batch (as with SyncBatchNorm), and evaluates in lockstep (`collective_forward`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from phalanx.data_parallel.replica_hook import ReplicaHook
from phalanx.data_parallel.sharding.params import ShardedParameters
from phalanx.errors import Misuse

_COLLECTIVE_FORWARD = "_phalanx_collective_forward"


def collective_forward(module: nn.Module) -> bool:
    """True when `module`'s forward is a collective (stage 3 gathers inside it): every rank must
    then call it as often as every other, with an empty batch where it has no rows."""
    return any(getattr(m, _COLLECTIVE_FORWARD, False) for m in module.modules())


class GatherHooks:
    """The hooks of one stage-3 replica over `params`; `close()` removes them."""

    def __init__(self, module: nn.Module, params: ShardedParameters) -> None:
        self._params = params
        bucket_of = {id(p): b.index for b in params.buckets for p in b.params}
        self._buckets_of: dict[int, list[int]] = {}
        self._users: dict[int, set[int]] = {b.index: set() for b in params.buckets}
        self._handles: list = []
        for sub in module.modules():
            mine = sorted({bucket_of[id(p)] for p in sub.parameters(recurse=False) if id(p) in bucket_of})
            if not mine:
                continue
            self._buckets_of[id(sub)] = mine
            for index in mine:
                self._users[index].add(id(sub))
            # ReplicaHooks: a deep copy of the module (inside dp.gathered_parameters()) keeps none of them.
            self._handles.append(sub.register_forward_pre_hook(ReplicaHook(self._before_forward), prepend=True))
            self._handles.append(sub.register_forward_hook(ReplicaHook(self._after_forward)))
        self._ran: dict[int, set[int]] = {index: set() for index in self._users}  # done since the gather
        self._module = module
        setattr(module, _COLLECTIVE_FORWARD, _Collective())
        self._handles.append(module.register_state_dict_pre_hook(ReplicaHook(self._before_state_dict)))

    def _before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        # At rest the parameters are empty tensors: a state dict of them would save nothing, silently.
        if not all(self._params.gathered):
            raise Misuse("shard=\"parameters\" spreads the parameters over the ranks: call "
                         "dp.full_state_dict() on every rank for the whole model's state dict (or "
                         "dp.module.state_dict() inside `with dp.gathered_parameters():`)")

    def _before_forward(self, sub: nn.Module, args: Any) -> None:
        mine = self._buckets_of[id(sub)]
        for index in mine:
            if not self._params.gathered[index]:
                self._ran[index].clear()
            self._params.ensure_gathered(index)
        self._params.prefetch(mine[0] - 1)  # forward runs the buckets from the last index down

    def _after_forward(self, sub: nn.Module, args: Any, output: Any) -> None:
        mine = self._buckets_of[id(sub)]
        recording = torch.is_grad_enabled()
        if recording:
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(lambda grad, mine=mine: self._before_backward(mine))
        for index in mine:
            self._ran[index].add(id(sub))
            if self._ran[index] >= self._users[index] and not (recording and index == 0):
                self._params.release(index)
                self._ran[index].clear()

    def _before_backward(self, mine: list[int]) -> None:
        for index in mine:
            self._params.ensure_gathered(index)
        self._params.prefetch(mine[-1] + 1)  # backward runs them from 0 up

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if hasattr(self._module, _COLLECTIVE_FORWARD):
            delattr(self._module, _COLLECTIVE_FORWARD)


class _Collective:
    """The mark of a module whose forward gathers: true, and false in a deep copy (which gathers nothing)."""

    def __bool__(self) -> bool:
        return True

    def __deepcopy__(self, memo: dict) -> bool:
        return False


def _tensors(output: Any):
    """The tensors in a module's output (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)
