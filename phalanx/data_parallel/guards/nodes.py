"""Replicas on several nodes compare their models before the first broadcast.

On one host the collective board compares every collective's size and dtype before gloo sees a
byte (runtime/board.py), so a rank whose model differs is one line. The board is a host's
shared memory: it cannot see the ranks of other nodes. Across torchrun's nodes a script that
built its model in float32 on one node and float64 on the other (an outside-user trial, 2
nodes x 1 worker, `phalanx.init()` and `phalanx.prepare`) ended in gloo aborting node 1's
process (SIGABRT, "Received data size doesn't match expected size") at prepare's broadcast of
rank 0's state, and node 0 with a lost connection. `check_same_model` runs where the ranks span
nodes (`World.node_sizes` is set): one `all_gather_object` of every parameter's and buffer's
name, shape and dtype and of the replica's options, and a difference is one ReplicaMismatch
naming the first tensor or option that differs, with the ranks and nodes on each side.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch

from phalanx.comm import Tag, gather_objects
from phalanx.data_parallel.guards.checks import ReplicaMismatch
from phalanx.runtime.world import World


def check_same_model(world: World, module: torch.nn.Module, options: Any) -> None:
    """Raise ReplicaMismatch on every rank alike where the ranks of several nodes prepare models
    of other tensors, or with other options (a dataclass); nothing on one host (the board's)."""
    if world.node_sizes is None or not world.distributed:
        return
    tensors = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
               for name, t in [*module.named_parameters(), *module.named_buffers()]]
    settings = {f.name: repr(getattr(options, f.name)) for f in fields(options)}
    gathered = gather_objects(world, {"node": world.node_rank, "tensors": tensors, "options": settings},
                              Tag("pre-flight check"))
    first = gathered[0]
    reference = f"rank 0 (node {first['node']})"
    for rank, theirs in enumerate(gathered):
        where = f"rank {rank} (node {theirs['node']})"
        if theirs["tensors"] != first["tensors"]:
            differs = _first_difference(first["tensors"], theirs["tensors"], reference, where)
            raise ReplicaMismatch(f"the nodes prepared different models: {differs} (a different model, dtype or code "
                                  "on that node?); build the same model on every rank before phalanx.prepare")
        for name, value in first["options"].items():
            if theirs["options"].get(name) != value:
                raise ReplicaMismatch(f"the nodes prepared their replicas with different options: {name} is {value} on "
                                      f"{reference} and {theirs['options'].get(name)} on {where}; pass every rank the "
                                      "same phalanx.prepare arguments")


def _first_difference(first: list, theirs: list, reference: str, where: str) -> str:
    """"0.weight is float64 (16, 8) on rank 0 (node 0) and float32 (16, 8) on rank 1 (node 1)"."""
    for mine, other in zip(first, theirs):
        if mine != other:
            if mine[0] != other[0]:
                return f"{reference} has {mine[0]} where {where} has {other[0]}"
            return f"{mine[0]} is {mine[2]} {mine[1]} on {reference} and {other[2]} {other[1]} on {where}"
    return f"{reference} has {len(first)} parameters and buffers, {where} {len(theirs)}"
