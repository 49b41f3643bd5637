"""How the replica's hooks sit on what the user owns: `ReplicaHook` on the module and its
parameters, so a copy of the module is not a replica; `on_every_optimizer_step` on torch's
process-wide optimizer step, held weakly, so it keeps no replica alive.

The replica hears of a backward through hooks on the module's parameters (a gradient landed: the
bucket's exchange, the forgotten-sync and unused-parameter guards) and of a forward through one
on the module (the first step's look). `copy.deepcopy(dp.module)` - an EMA (`AveragedModel`), a
teacher, a frozen snapshot - copies a parameter's and a module's hooks with it, and deep-copying a
bound method copies its object: the replica, which refuses to be copied (it holds this rank's
buckets and communication), so the copy failed with that TypeError on every rank, the very call
the refusal recommends. A `ReplicaHook` is a `functools.partial` (called from C: no Python frame
of its own on the per-gradient path) whose deep copy is a no-op: the copy keeps no hook of the
replica's, and its gradients, if any, are nobody's exchange. Pickling one (`torch.save(dp.module)`)
is refused in one line naming what to save instead.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle


def _ignored(*args: Any, **kwargs: Any) -> None:
    """What a copied module calls in place of the replica's hook: nothing."""
    return None


class ReplicaHook(functools.partial):
    """`fn` as a hook of the replica's; `copy.deepcopy` of what holds it gets `_ignored` instead."""

    def __deepcopy__(self, memo: dict) -> Any:
        return _ignored

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(MODULE_NOT_PICKLED)


MODULE_NOT_PICKLED = ("a prepared model (dp.module) cannot be pickled: it carries its replica's hooks, which hold this "
                      "rank's buckets and communication; save its weights, torch.save(dp.state_dict()), or pickle "
                      "copy.deepcopy(dp.module) (under shard=\"parameters\": dp.full_state_dict(), or the copy made "
                      "inside `with dp.gathered_parameters():`, on every rank)")


def on_every_optimizer_step(method: Callable[[torch.optim.Optimizer], None]) -> RemovableHandle:
    """Call the bound `method(optimizer)` before any optimizer of this process steps, while its
    object lives: the hook is process-wide and holds the object weakly (a `WeakMethod`), so a
    replica dropped without close() is collected and its hook does nothing. The handle removes it."""
    weak = weakref.WeakMethod(method)

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        target = weak()
        if target is not None:
            target(optimizer)

    return register_optimizer_step_pre_hook(hook)


class OptimizerVerdicts:
    """Each optimizer's answer to a question about its parameters (does it step this replica?),
    taken at its first step and again whenever its group count changes: a group added with
    add_param_group after the first step (a backbone unfrozen) changes the answer, and torch's step
    hook does not say so. Held weakly: an id could be a dead optimizer's."""

    def __init__(self) -> None:
        self._taken: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> (groups, verdict)

    def of(self, optimizer: torch.optim.Optimizer, judge: Callable[[torch.optim.Optimizer], bool]) -> bool:
        """`judge(optimizer)`, as taken for its present group count."""
        groups, verdict = self._taken.get(optimizer, (None, False))
        if groups != len(optimizer.param_groups):
            groups, verdict = self._taken[optimizer] = (len(optimizer.param_groups), judge(optimizer))
        return verdict

    def __len__(self) -> int:
        return len(self._taken)


def steps_replica(optimizer: torch.optim.Optimizer, module: torch.nn.Module, sharding) -> bool:
    """Whether `optimizer` steps the replica of `module`: it holds any of its parameters, or it is one
    of `sharding`'s (`dp.optimizer`'s over this rank's shards; None: not sharded)."""
    ours = {id(p) for p in module.parameters()}
    return any(id(p) in ours for group in optimizer.param_groups for p in group["params"]) or (
        sharding is not None and optimizer in sharding.optimizers)
