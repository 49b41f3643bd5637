"""Modules that have nothing to broadcast yet, refused where a replica is built, in one line naming the fix.

A lazy module (`nn.LazyLinear`) has no shapes until its first forward; one built on the meta
device (deferred initialization, as torchtitan builds a model) has no values until it is
materialized. Neither can be broadcast from rank 0 or laid out in buckets, and either would die
inside torch (`UninitializedParameter`, "Cannot copy out of meta tensor"). `prepare` refuses them
before converting anything, and `DataParallel` before it moves the module (`placed`), on every
world size alike, so a script fails on one device where it would on k.
"""

from __future__ import annotations

import torch
from torch import nn


def refuse_uninitialized(module: nn.Module) -> None:
    """A lazy module's parameters have no shape until its first forward, a meta one's no values
    (deferred initialization): nothing to broadcast or lay out in buckets. Refused on every world
    size alike, so a script fails on one device where it would on k, with the fix."""
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        owner = type(module.get_submodule(name.rpartition(".")[0])).__name__
        if nn.parameter.is_lazy(tensor):  # DDP refuses them too
            raise ValueError(f"{name} is not initialized yet ({owner} infers its shape at the first forward): "
                             "run one forward with a batch of your data before phalanx.prepare, on every rank, "
                             "then prepare")
        if tensor.is_meta:
            raise ValueError(f"{name} ({owner}) is on the meta device and holds no values: materialize the model "
                             "before phalanx.prepare, model.to_empty(device=world.device) then initialize it (each "
                             "module's reset_parameters(), or your init; prepare broadcasts rank 0's values)")


def placed(module: nn.Module, device: torch.device) -> nn.Module:
    """`module` moved to `device`, once `refuse_uninitialized` found nothing to refuse."""
    refuse_uninitialized(module)
    return module.to(device)
