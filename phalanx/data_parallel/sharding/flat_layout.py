"""The one flat order of a replica's parameters, and its cut into k contiguous shards (ZeRO).

Sharded data parallelism (Rajbhandari et al. 2020, "ZeRO: memory optimizations toward training
trillion parameter models") keeps on each rank only a 1/k share of the optimizer state, the
gradients or the parameters themselves. Which share is decided here, once, from the parameter
list alone:

- **The flat order** is the order the gradient buckets hold the parameters in (buckets.py):
  trainable parameters in reverse registration order, each in its *memory* order (a
  channels_last weight as it lies in memory), back to back. It depends neither on k nor on the
  bucket cap, so state written at k devices can be read at any other k.
- **The shards**: rank r owns the contiguous range `shard_bounds(total, k, r)` of that order -
  the book's `split_batch` cut, so sizes differ by at most one element and every rank's share
  is as even as it can be. A shard may cut a parameter (or a bucket) in two.
- **A bucket's counts**: a bucket is a contiguous range of the flat order too, so the part of it
  each rank owns is an intersection; its reduce-scatter and all-gather take those per-rank
  counts (most are 0: a bucket usually lies within one or two ranks' shards).

Why one order cut evenly rather than each bucket cut k ways (DeepSpeed's and FSDP1's flat
parameters pad and cut every unit): a rank's shard is then one range whatever the bucket cap,
its optimizer state is that range of each state tensor, and a checkpoint is k files of ranges
that any other k reads by intersecting ranges - no padding, no per-bucket bookkeeping to match.
The price is per-bucket imbalance inside a step (a bucket's owner sums it alone), which evens
out over the step's buckets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from phalanx.data.split import shard_bounds
from phalanx.data_parallel.buckets import Bucket, grad_view


@dataclass(frozen=True, kw_only=True)
class Slot:
    """Where one parameter lies in the flat order."""

    name: str
    offset: int  # first element in the flat order
    numel: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]  # its memory layout: the flat order holds it in this order
    bucket: int  # the bucket that holds it
    bucket_offset: int  # its first element inside that bucket

    @property
    def stop(self) -> int:
        return self.offset + self.numel

    def describe(self) -> dict:
        """The slot as plain data (a checkpoint's manifest records the layout so)."""
        return {"name": self.name, "offset": self.offset, "numel": self.numel, "shape": list(self.shape),
                "stride": list(self.stride), "bucket": self.bucket, "bucket_offset": self.bucket_offset}

    @classmethod
    def of(cls, record: dict) -> "Slot":
        """The slot `describe` wrote."""
        return cls(name=record["name"], offset=record["offset"], numel=record["numel"], shape=tuple(record["shape"]),
                   stride=tuple(record["stride"]), bucket=record["bucket"], bucket_offset=record["bucket_offset"])


@dataclass(frozen=True, kw_only=True)
class Piece:
    """A parameter's part of a flat range: elements [start, stop) of `slot` in memory order."""

    slot: Slot
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def intersect(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    """The overlap of two [start, stop) ranges, as an empty range at a's start when they miss."""
    start, stop = max(a[0], b[0]), min(a[1], b[1])
    return (start, stop) if start < stop else (a[0], a[0])


class FlatLayout:
    """The flat order of `buckets`' parameters (named by `names`), cut into `world_size` shards."""

    def __init__(self, buckets: Sequence[Bucket], *, names: dict[int, str], world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size = world_size
        self._names = dict(names)
        slots, bucket_ranges, offset = [], [], 0
        for bucket in buckets:
            start = offset
            for param, within in zip(bucket.params, bucket.offsets):
                slots.append(Slot(name=names[id(param)], offset=start + within, numel=param.numel(),
                                  shape=tuple(param.shape), stride=tuple(param.stride()), bucket=bucket.index,
                                  bucket_offset=within))
            offset += bucket.buffer.numel()
            bucket_ranges.append((start, offset))
        self.slots: list[Slot] = slots
        self.total = offset
        self.bucket_ranges: list[tuple[int, int]] = bucket_ranges

    def name_of(self, param: nn.Parameter) -> str:
        """The name of a parameter of this layout."""
        return self._names[id(param)]

    def shard(self, rank: int) -> tuple[int, int]:
        """[start, stop) of the flat order that `rank` owns."""
        return shard_bounds(self.total, self.world_size, rank)

    def counts(self, bucket: int) -> list[int]:
        """How many elements of bucket `bucket` each rank owns (its collectives' counts)."""
        span = self.bucket_ranges[bucket]
        return [hi - lo for lo, hi in (intersect(span, self.shard(rank)) for rank in range(self.world_size))]

    def owned(self, bucket: int, rank: int) -> tuple[int, int]:
        """[start, stop) *inside* bucket `bucket` of what `rank` owns (empty: start == stop)."""
        span = self.bucket_ranges[bucket]
        start, stop = intersect(span, self.shard(rank))
        return start - span[0], stop - span[0]

    def pieces(self, start: int, stop: int) -> list[Piece]:
        """The parameters' parts of the flat range [start, stop), in flat order."""
        found = []
        for slot in self.slots:
            lo, hi = intersect((slot.offset, slot.stop), (start, stop))
            if hi > lo:
                found.append(Piece(slot=slot, start=lo - slot.offset, stop=hi - slot.offset))
        return found

    def describe(self) -> list[dict]:
        """The layout as a checkpoint's manifest records it: what any k needs to read a range back."""
        return [slot.describe() for slot in self.slots]


def memory_order(tensor: torch.Tensor) -> torch.Tensor:
    """A dense tensor's elements as a 1-D view in the order they lie in memory (channels_last
    weights included): how the flat order holds a parameter, its gradient and its state."""
    if tensor.is_contiguous():
        return tensor.view(-1)
    return tensor.as_strided((tensor.numel(),), (1,), tensor.storage_offset())


def memory_order_of(value: torch.Tensor, slot: Slot, *, device: torch.device | None = None) -> torch.Tensor:
    """`value` (a tensor of `slot`'s shape, in any layout: a state dict's) as 1-D in the slot's
    memory order, copied into the slot's strides on `device` (default: value's) first."""
    laid = torch.empty_strided(slot.shape, slot.stride, dtype=value.dtype, device=device or value.device)
    laid.copy_(value)
    return memory_order(laid)


def laid_out_like(flat: torch.Tensor, shape: Sequence[int], stride: Sequence[int]) -> torch.Tensor:
    """The inverse of `memory_order`: a tensor of `shape` whose memory is `flat` (1-D, dense),
    laid out with `stride` (the parameter's own layout)."""
    return flat.as_strided(tuple(shape), tuple(stride), flat.storage_offset())


def parameter_names(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> its name in `module` (the first name, for a parameter shared by two)."""
    names: dict[int, str] = {}
    for name, param in module.named_parameters():
        names.setdefault(id(param), name)
    return names


def free_storage(tensor: torch.Tensor) -> None:
    """Give `tensor`'s memory back, keeping the tensor (its shape, its views) for a later refill."""
    storage = tensor.untyped_storage()
    if storage.nbytes():
        storage.resize_(0)


def refill_storage(tensor: torch.Tensor) -> None:
    """Allocate `tensor`'s memory again after `free_storage` (its values are garbage until written)."""
    storage, needed = tensor.untyped_storage(), (tensor.storage_offset() + tensor.numel()) * tensor.element_size()
    if storage.nbytes() < needed:
        storage.resize_(needed)


def flatten_parameters(bucket: Bucket, flat: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One flat parameter buffer for `bucket` (`flat`, or a new one), laid out as its gradient
    buffer (buckets.grad_view: each parameter in its memory order), and each parameter's view
    into it; every parameter becomes that view (the same Parameter object, shape and strides,
    its values copied)."""
    if flat is None:
        flat = torch.empty(bucket.buffer.numel(), dtype=bucket.buffer.dtype, device=bucket.buffer.device)
    views = []
    for param, offset in zip(bucket.params, bucket.offsets):
        view = grad_view(flat, offset, param)
        with torch.no_grad():
            view.copy_(param.detach())
        param.data = view
        views.append(view)
    return flat, views
