"""Gradient buckets: flat buffers that the parameters' `.grad` tensors live inside as views.

One collective per bucket instead of one per tensor: on gloo every call pays a ~0.6-1.2 ms floor
(loopback TCP, however small), so LeNet's 8 gradient tensors cost ~15 ms as 8 calls and ~3.6 ms as one.
Parameters are packed in *reverse* registration order - the order autograd produces their
gradients - so that overlap.py can launch a bucket as soon as its last gradient
lands (the choice torch DDP makes in `_compute_bucket_assignment_by_size`). With
`cap_bytes=None` everything goes into one bucket. A cap is an upper bound: a bucket exceeds it
only when a single tensor does. The first bucket may have a smaller cap of its own
(`first_cap_bytes`): it holds the gradients autograd produces first, so a small one starts
communication earliest (DDP's `bucket_size_limits`, 1 MiB then 25 MiB; see
`default_first_cap_bytes`). The layout depends only on the parameter list, so it is the same on
every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(kw_only=True)
class Bucket:
    index: int
    buffer: torch.Tensor  # 1-D, holds the gradients of `params` back to back
    params: list[nn.Parameter] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # element offset of each param's grad
    # What its allreduce sends: `buffer`, then any spare elements (the last bucket's usage flags, usage.py).
    storage: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.storage is None:
            self.storage = self.buffer

    @property
    def size_bytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @property
    def sent_bytes(self) -> int:
        """What its allreduce carries in the gradients' dtype: the buffer, then any spare elements."""
        return self.storage.numel() * self.storage.element_size()


# DDP's first-bucket size (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES).
DDP_FIRST_BUCKET_BYTES = 1024 * 1024


def mb_to_bytes(mb: float | None) -> int | None:
    """A cap in MB (binary) as bytes, at least 1; None (one bucket) stays None."""
    return None if mb is None else max(1, int(mb * 1024 * 1024))


def default_first_cap_bytes(cap_bytes: int | None) -> int | None:
    """DDP's rule: the first bucket holds at most min(cap, 1 MiB); None (one bucket) stays None.

    Why small: the first bucket's allreduce cannot start before its last gradient lands, and
    everything after it waits behind it; the smaller it is, the sooner the pipe starts. For
    LeNet (504 KB in all) every CPU-sensible cap is below 1 MiB, so this changes nothing there.
    """
    return None if cap_bytes is None else min(cap_bytes, DDP_FIRST_BUCKET_BYTES)


def _dense_strides(tensor: torch.Tensor) -> bool:
    """True when `tensor`'s strides are a permutation of a packed layout (no gaps, no overlap)."""
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride()), key=lambda d: (d[1], d[0])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def grad_view(buffer: torch.Tensor, offset: int, param: torch.Tensor) -> torch.Tensor:
    """`buffer[offset : offset + param.numel()]` as a tensor with `param`'s shape *and strides*.

    A gradient laid out like its parameter is what autograd accumulates into without a layout
    change (DDP's "gradient layout contract"): a channels_last conv weight gets a channels_last
    gradient view. Parameters with gaps or overlaps in memory get a contiguous view.
    The strides are the parameter's own even where `is_contiguous()` calls both layouts the same:
    a channels_last conv weight of one input channel, (6, 1, 5, 5) with strides (25, 1, 5, 1), is
    contiguous too, but a sharded replica's parameter becomes this view, and with (25, 25, 5, 1)
    the convolution took the contiguous format and every activation after it was converted back
    to channels_last (ZeRO-1 and 2 steps 1-2 ms slower on a 2-core host, measured 2026-12-02).
    """
    if not _dense_strides(param):
        return buffer[offset : offset + param.numel()].view_as(param)
    return buffer.as_strided(param.shape, param.stride(), buffer.storage_offset() + offset)


def build_buckets(
    params: list[nn.Parameter], *, cap_bytes: int | None = None, first_cap_bytes: int | None = None,
    gradient_views: bool = True, spare: int = 0,
) -> list[Bucket]:
    """Group trainable params into buckets (reverse order) and make each `.grad` a view.

    `first_cap_bytes` bounds the first bucket only (None: the same as `cap_bytes`). `spare`
    elements follow the last bucket's gradients in its `storage` (zeros; not in its `buffer`). Existing
    gradient values are copied into the buffers, so this may be called on a model that has
    already run backward. `gradient_views=False` (sharded stages 2, 3: a bucket's buffer exists
    only while it is sent) lays the buckets out without touching a byte of their buffers and
    leaves the gradients alone.
    """
    for name, value in (("cap_bytes", cap_bytes), ("first_cap_bytes", first_cap_bytes)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1 byte, got {value}")
    trainable = [p for p in params if p.requires_grad]
    groups: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    current_bytes = 0
    for param in reversed(trainable):
        size = param.numel() * param.element_size()
        cap = cap_bytes if groups or first_cap_bytes is None else first_cap_bytes
        # A bucket holds one dtype/device; start a new one on a change or when the cap is hit.
        mismatch = current and (param.dtype != current[0].dtype or param.device != current[0].device)
        if current and (mismatch or (cap is not None and current_bytes + size > cap)):
            groups.append(current)
            current, current_bytes = [], 0
        current.append(param)
        current_bytes += size
    if current:
        groups.append(current)

    buckets = []
    for index, group in enumerate(groups):
        total = sum(p.numel() for p in group)
        make = torch.zeros if gradient_views else torch.empty  # empty: no page of it touched
        extra = spare if index == len(groups) - 1 else 0
        storage = make(total + extra, dtype=group[0].dtype, device=group[0].device)
        bucket = Bucket(index=index, buffer=storage[:total] if extra else storage, storage=storage)
        offset = 0
        for param in group:
            if gradient_views:
                view = grad_view(bucket.buffer, offset, param)
                if param.grad is not None:  # (a sparse one added into the zeroed slot)
                    view.copy_(param.grad) if param.grad.layout == torch.strided else view.add_(param.grad)
                # Autograd accumulates in place into an existing .grad, so backward writes straight
                # into the bucket (DDP's gradient_as_bucket_view): no copy before the allreduce.
                param.grad = view
            bucket.params.append(param)
            bucket.offsets.append(offset)
            offset += param.numel()
        buckets.append(bucket)
    return buckets


def grads_are_bucket_views(buckets: list[Bucket]) -> bool:
    """True while every param's .grad still aliases its bucket (someone may have replaced it).
    Checked at every synced step, so by address arithmetic: a slice per parameter to read its
    address cost LeNet's 8 parameters 12 µs a step."""
    for bucket in buckets:
        base, size = bucket.buffer.data_ptr(), bucket.buffer.element_size()
        for param, offset in zip(bucket.params, bucket.offsets):
            grad = param.grad
            if grad is None or grad.layout != torch.strided or grad.data_ptr() != base + offset * size:
                return False
    return True


def wire_of(buffer: torch.Tensor, grad_dtype: torch.dtype | None) -> torch.Tensor:
    """What goes on the wire for a bucket's `buffer`: itself, or a copy compressed to `grad_dtype`."""
    if grad_dtype is None or grad_dtype == buffer.dtype:
        return buffer
    return buffer.detach().to(grad_dtype)


class DecompressingHandle:
    """A compressed bucket's pending allreduce: `wait()` also writes the sum back, widened."""

    def __init__(self, handle, wire: torch.Tensor, buffer: torch.Tensor) -> None:
        self._handle, self._wire, self._buffer = handle, wire, buffer

    @property
    def waited(self) -> bool:
        return self._handle.waited

    def wait(self) -> torch.Tensor:
        self._handle.wait()
        with torch.no_grad():
            self._buffer.copy_(self._wire)
        return self._buffer
