"""`ReplicaHook`: how the replica's hooks sit on a user's module and parameters, so a copy of the
module is not a replica.

The replica hears of a backward through hooks on the module's parameters (a gradient landed: the
bucket's exchange, the forgotten-sync and unused-parameter guards) and of a forward through one
on the module (the first step's look). `copy.deepcopy(dp.module)` - an EMA (`AveragedModel`), a
teacher, a frozen snapshot - copies a parameter's and a module's hooks with it, and deep-copying a
bound method copies its object: the replica, which refuses to be copied (it holds this rank's
buckets and communication), so the copy failed with that TypeError on every rank, the very call
the refusal recommends. A `ReplicaHook` is a `functools.partial` (called from C: no Python frame
of its own on the per-gradient path) whose deep copy is a no-op: the copy keeps no hook of the
replica's, and its gradients, if any, are nobody's exchange.
"""

from __future__ import annotations

import functools
from typing import Any


def _ignored(*args: Any, **kwargs: Any) -> None:
    """What a copied module calls in place of the replica's hook: nothing."""
    return None


class ReplicaHook(functools.partial):
    """`fn` as a hook of the replica's; `copy.deepcopy` of what holds it gets `_ignored` instead."""

    def __deepcopy__(self, memo: dict) -> Any:
        return _ignored
