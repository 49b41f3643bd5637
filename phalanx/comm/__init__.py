"""Collectives for data parallelism: the book's `allreduce`, with a choice of algorithm, and its
two halves for sharded data parallelism, `reduce_scatter` and `all_gather` (shards.py); and for
a user's loop, `gather` (every rank's rows, concatenated), `barrier` and `broadcast` (gather.py).

`allreduce(tensor, world=..., algorithm=...)` sums a tensor in place across all ranks. The
algorithms are written from scratch over point-to-point messages (`transport.py`), one module
each, and all are checked against the backend's own `all_reduce` (`native`):

- `native`: `dist.all_reduce` (gloo/NCCL pick their own algorithm).
- `shm`:    through a shared-memory segment, for the CPU workers of one host (`shm.py`); what
            the default, `auto`, picks there (`resolve_algorithm`).
- `hierarchical`: shm within each host, a ring between hosts over gloo (`hierarchical.py`);
            what `auto` picks for CPU workers on several hosts of several workers each.
- `ring`:   bandwidth-optimal reduce-scatter + all-gather (Patarasuk & Yuan 2009).
- `tree`:   latency-optimal recursive doubling, folded for non-power-of-two worlds.
- `naive`:  the D2L chapter's gather-to-rank-0, sum, send back.

Every algorithm leaves all ranks with bitwise identical results, so replicas never drift.
Each one is a plain function `allreduce_<name>(flat, *, world)` over a contiguous 1-D tensor;
`allreduce` adapts any tensor (any shape, non-contiguous) to that form. `AsyncComm` launches
the same algorithms without blocking and hands back a `Handle` to wait on (`async_ops.py`);
`open_comm` opens the one a replica exchanges through, falling back from shm where auto must.
Every collective call takes a `Tag` saying what it is (phase, bucket, step), which the board
records and a failure names (calls.py); a call that says nothing is a plain "allreduce".
In a world of size 1 there is no process group and every collective returns at once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.graph import increment_version

from phalanx.comm.agreed import agreed_outcome, gather_objects
from phalanx.comm.algorithms import ALGORITHMS, CHOICES, allreduce_fn, apply_flat, check_choice, resolve_algorithm
from phalanx.comm.async_ops import ALLREDUCE, AsyncComm, OpenedComm, open_comm
from phalanx.comm.calls import collective, native, run_collective
from phalanx.comm.gather import barrier, broadcast, gather
from phalanx.comm.handle import Handle
from phalanx.comm.hierarchical import Hierarchy, allreduce_hierarchical
from phalanx.comm.hosts import HostLayout, hierarchy_applies
from phalanx.comm.naive import allreduce_naive
from phalanx.comm.native import allreduce_native
from phalanx.comm.ring import allreduce_ring
from phalanx.comm.shards import all_gather, reduce_scatter
from phalanx.comm.shm import ShmError, ShmGroup, shm_applies
from phalanx.comm.shm_ops import allreduce_shm
from phalanx.comm.tree import allreduce_tree
from phalanx.comm.watchdog import CollectiveMismatch, PeerFinished, PeerGone, PeerStalled
from phalanx.runtime.call_habits import phalanx_call
from phalanx.runtime.tags import Tag
from phalanx.runtime.world import World

__all__ = [
    "agreed_outcome",
    "ALGORITHMS",
    "AsyncComm",
    "CHOICES",
    "CollectiveMismatch",
    "PeerFinished",
    "PeerGone",
    "PeerStalled",
    "Handle",
    "Hierarchy",
    "HostLayout",
    "OpenedComm",
    "ShmError",
    "ShmGroup",
    "Tag",
    "all_reduce_sum_",
    "allreduce",
    "allreduce_fn",
    "allreduce_hierarchical",
    "allreduce_naive",
    "allreduce_native",
    "allreduce_ring",
    "allreduce_shm",
    "allreduce_tree",
    "all_gather",
    "barrier",
    "broadcast",
    "broadcast_",
    "check_choice",
    "collective",
    "gather",
    "hierarchy_applies",
    "native",
    "open_comm",
    "reduce_scatter",
    "resolve_algorithm",
    "shm_applies",
]


@phalanx_call  # torch.distributed's op=, the World by position: one line (call_habits.py)
@torch.no_grad()
def allreduce(tensor: torch.Tensor, *, world: World, algorithm: str = "native", transport=None,
              tag: Tag = ALLREDUCE) -> torch.Tensor:
    """Sum `tensor` in place across all ranks of `world` and return it (D2L's `allreduce`).

    Every rank must call this with a tensor of the same shape and dtype, in the same order.
    The algorithm name is validated even in a world of size 1, where nothing else happens.
    `transport`: what the algorithm runs over (an `ShmGroup` for shm; default group otherwise).
    `tag`: what the call is, as a failure names it (e.g. Tag("evaluation"); default "allreduce").
    """
    world.check_here("phalanx.allreduce")
    if algorithm == "auto":
        raise ValueError("phalanx.allreduce takes one algorithm, not 'auto' (prepare()'s choice, which opens "
                         f"the transport it picks); choose one of {', '.join(ALGORITHMS)}")
    fn = allreduce_fn(algorithm)
    if any(stride == 0 and size > 1 for stride, size in zip(tensor.stride(), tensor.shape)):
        raise ValueError(f"allreduce: a tensor of shape {tuple(tensor.shape)} whose elements share memory (stride 0, "
                         "from expand()) cannot hold a sum per element; pass tensor.clone()")
    if not world.distributed:
        return tensor
    apply_flat(tensor, lambda flat: run_collective(
        world, algorithm, tag, flat, transport=transport,
        start=lambda: dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True),
        job=lambda transport, ticket: fn(flat, world=world, transport=transport, ticket=ticket)))
    # Every algorithm counts as an in-place write for autograd (the Python ones are; the backend's
    # and the compiled shm kernel write through the data pointer): a tensor saved for a backward
    # is then refused by that backward, whichever algorithm ran, instead of differentiated at
    # the summed value on some algorithms only.
    increment_version(tensor)
    return tensor


def all_reduce_sum_(tensor: torch.Tensor, *, world: World, tag: Tag = Tag("metrics")) -> torch.Tensor:
    """Sum `tensor` in place with the backend's all_reduce: for metrics (loss sums, counts)."""
    return allreduce(tensor, world=world, algorithm="native", tag=tag)


@torch.no_grad()
def broadcast_(tensor: torch.Tensor, *, world: World, src: int = 0, tag: Tag = Tag("broadcast")) -> torch.Tensor:
    """Overwrite `tensor` on every rank with rank `src`'s values (rank 0's state at start)."""
    if not 0 <= src < world.world_size:
        raise ValueError(f"broadcast source rank {src} outside world of size {world.world_size}")
    if world.distributed:
        tag = tag.sent_from(src)
        apply_flat(tensor, lambda flat: native(world, tag, lambda: dist.broadcast(flat, src=src, async_op=True),
                                               size_bytes=flat.numel() * flat.element_size(), dtype=flat.dtype))
    return tensor
