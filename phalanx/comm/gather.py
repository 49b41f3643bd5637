"""`gather` and `barrier`: the two collectives a user's loop asks for besides the sums.

`gather(tensor, world=)` returns every rank's rows, concatenated along dim 0 in rank order, on
every rank: the predictions or labels of a global batch, for a metric that is not a sum
(Accelerate's `gather_for_metrics`, Fabric's `all_gather` then a reshape). Ranks may hold
different numbers of rows (the last global batch splits unevenly: `shard_sizes`), and because
each rank's shard is its contiguous slice of the global batch (`rank_shard`), the gathered rows
are the global batch's, in its order, as one device would have them: nothing padded, nothing
repeated, nothing to drop. A 0-d tensor counts as one row. Two backend all-gathers: first each
rank's shape and dtype (so a rank whose rows do not match is named on every rank, not met with
a hang or garbage), then the rows padded to the longest shard.

`barrier(world=)` returns once every rank has called it (Accelerate's `wait_for_everyone`,
Fabric's `barrier`): e.g. rank 0 writes a file the others then read. `with main_first(world=):`
runs its block on rank 0 (or each host's first rank) before the others (Accelerate's
`main_process_first`, Fabric's `rank_zero_first`): a download or a cache one rank fills and the
rest then read, instead of k ranks writing the same files at once. `broadcast(obj, world=)`
gives every rank rank `src`'s object (Fabric's `broadcast`, Accelerate's `broadcast_object_list`):
a run name, a seed, a tensor; pickled by torch.save on `src` (tensors arrive on the world's
device), two backend broadcasts (the length, then the bytes). In a world of one each returns at
once.
All wait at most the world's timeout, and a rank that never arrives is named, as for every
collective (calls.py).
"""

from __future__ import annotations

import contextlib
import io
import math
from typing import Any, Iterator

import torch
import torch.distributed as dist

from phalanx.comm.agreed import agreed_outcome
from phalanx.comm.calls import native
from phalanx.runtime.call_habits import phalanx_call
from phalanx.runtime.tags import Tag
from phalanx.runtime.world import World

MAX_DIMS = 8  # the header holds this many sizes; a tensor with more dimensions is refused
_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)


def _all_gather(tensor: torch.Tensor, *, world: World, tag: Tag) -> list[torch.Tensor]:
    """Every rank's `tensor` (the same shape on every rank), by rank: the backend's all-gather."""
    pieces = [torch.empty_like(tensor) for _ in range(world.world_size)]
    native(world, tag, lambda: dist.all_gather(pieces, tensor, async_op=True),
           size_bytes=tensor.numel() * tensor.element_size(), dtype=tensor.dtype)
    return pieces


@phalanx_call
def barrier(*, world: World, tag: Tag = Tag("barrier")) -> None:
    """Return once every rank of `world` has called barrier (at once in a world of one)."""
    world.check_here("phalanx.barrier")
    if world.distributed:
        native(world, tag, lambda: dist.barrier(async_op=True), size_bytes=0)


@phalanx_call  # Fabric's local=, the World by position: one line (call_habits.py)
@contextlib.contextmanager
def main_first(*, world: World, per_host: bool = False) -> Iterator[None]:
    """Run the block on rank 0 first (`per_host`: on each host's local rank 0, for files on
    each host's own disk), then on every other rank: one agreement (comm/agreed.py), which the
    first ranks reach after the block and the others before it. Where a first rank's block
    raises, every rank raises it there, the others without running theirs: a script that catches
    a failed download around the `with` goes on in step on every rank (before 2026-12-06 the others
    ran their block and waited in a barrier rank 0 never reached). The others wait at most the
    world's timeout (`--timeout`), which a longer block needs raised."""
    world.check_here("phalanx.main_first")
    first = world.local_rank == 0 if per_host else world.is_main
    if not first:
        with agreed_outcome(world, Tag("barrier")):
            pass
        yield
        return
    with agreed_outcome(world, Tag("barrier")):
        yield


def _header(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[dtype index, ndim, size 0, ..., size ndim-1, 0 ...]: what each rank's peers check."""
    if rows.dtype not in _DTYPES:
        raise ValueError(f"gather: dtype {rows.dtype} is not supported; use one of "
                         f"{', '.join(str(d).removeprefix('torch.') for d in _DTYPES)}")
    if rows.dim() > MAX_DIMS:
        raise ValueError(f"gather: a tensor of {rows.dim()} dimensions; at most {MAX_DIMS} are gathered")
    sizes = list(rows.shape) + [0] * (MAX_DIMS - rows.dim())
    return torch.tensor([_DTYPES.index(rows.dtype), rows.dim(), *sizes], dtype=torch.int64, device=device)


def _describe(header: list[int]) -> str:
    dtype, ndim = _DTYPES[header[0]], header[1]
    return f"{str(dtype).removeprefix('torch.')} rows of shape {tuple(header[3:2 + ndim])}"


def per_leaf(collection: Any, fn) -> Any:
    """`collection` (a dict, list, tuple or named tuple, nested) with `fn` applied to each leaf, in its
    order, which every rank's same code makes the same: one collective per leaf, in step on every rank."""
    if isinstance(collection, dict):
        return {key: per_leaf(value, fn) for key, value in collection.items()}
    if isinstance(collection, tuple) and hasattr(collection, "_fields"):
        return type(collection)(*(per_leaf(value, fn) for value in collection))
    if isinstance(collection, (list, tuple)):
        return type(collection)(per_leaf(value, fn) for value in collection)
    return fn(collection)


@phalanx_call
@torch.no_grad()
def gather(tensor: torch.Tensor, *, world: World, tag: Tag = Tag("metrics")) -> torch.Tensor:
    """Every rank's `tensor` concatenated along dim 0 in rank order, on every rank (a
    collective: every rank calls it at the same point). Ranks may differ in the number of rows,
    not in what a row is (its trailing shape and dtype): a mismatch is a ValueError on every
    rank naming both. The caller's tensor is left as it was; the result is a new tensor on
    `world.device` (a 0-d tensor counts as one row). A tuple, list or dict of tensors (nested)
    gives the same collection, each tensor gathered."""
    world.check_here("phalanx.gather")
    if isinstance(tensor, (dict, list, tuple)):  # Accelerate's gather_for_metrics((preds, labels)), Fabric's all_gather
        return per_leaf(tensor, lambda leaf: gather(leaf, world=world, tag=tag))
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"gather takes a tensor (or a tuple, list or dict of them), got {type(tensor).__name__}: wrap "
                         "numbers in torch.tensor(...)")
    rows = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
    header = _header(rows, world.device)
    if not world.distributed:
        return rows.to(world.device, copy=True)
    found = [h.tolist() for h in _all_gather(header, world=world, tag=tag)]
    mine = found[world.rank]
    for rank, theirs in enumerate(found):
        if theirs[0] != mine[0] or theirs[1] != mine[1] or theirs[3:] != mine[3:]:
            raise ValueError(f"gather: rank {rank} has {_describe(theirs)}, rank {world.rank} {_describe(mine)}; "
                             "every rank's rows must have the same trailing shape and dtype")
    counts = [theirs[2] for theirs in found]
    # Rows travel as bytes, one row per line, so every dtype goes alike: gloo's all-gather has
    # no int16 or bool, NCCL's no bool.
    row_shape = rows.shape[1:]
    if math.prod(row_shape) == 0:  # rows of no elements (alike on every rank): nothing to send
        return rows.new_empty((sum(counts), *row_shape), device=world.device)
    wire = rows.to(world.device).reshape(rows.shape[0], math.prod(row_shape)).contiguous().view(torch.uint8)
    padded = wire.new_zeros((max(counts), wire.shape[1]))
    padded[:wire.shape[0]] = wire
    pieces = _all_gather(padded, world=world, tag=tag)
    joined = torch.cat([piece[:count] for piece, count in zip(pieces, counts)])
    return joined.view(rows.dtype).reshape(joined.shape[0], *row_shape)


@phalanx_call
@torch.no_grad()
def broadcast(obj: Any, *, src: int = 0, world: World, tag: Tag = Tag("broadcast")) -> Any:
    """Rank `src`'s `obj` on every rank (a collective: every rank calls it at the same point, the
    other ranks with any placeholder, e.g. None): any object torch.save can pickle; tensors in it
    arrive on `world.device`. Rank `src` gets its own `obj` back."""
    world.check_here("phalanx.broadcast")
    if not isinstance(src, int) or not 0 <= src < world.world_size:
        raise ValueError(f"broadcast: src={src!r} is not a rank of this world of {world.world_size}; "
                         f"use 0..{world.world_size - 1}")
    if not world.distributed:
        return obj
    tag = tag.sent_from(src)
    payload = None
    if world.rank == src:
        saved = io.BytesIO()
        torch.save(obj, saved)
        payload = torch.frombuffer(bytearray(saved.getvalue()), dtype=torch.uint8).to(world.device)
    size = torch.tensor([0 if payload is None else payload.numel()], dtype=torch.int64, device=world.device)
    native(world, tag, lambda: dist.broadcast(size, src, async_op=True), size_bytes=8)
    if payload is None:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=world.device)
    native(world, tag, lambda: dist.broadcast(payload, src, async_op=True), size_bytes=payload.numel())
    if world.rank == src:
        return obj
    return torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), map_location=world.device, weights_only=False)
