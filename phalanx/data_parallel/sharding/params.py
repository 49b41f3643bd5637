"""A sharded replica's parameters: flat per bucket, this rank's range kept, the rest gathered.

Every stage makes each bucket's parameters views into one flat buffer laid out as the bucket's
gradients (flat_layout.py), so this rank's range of a bucket is one slice, and the optimizer's
pieces (optim.py) are views of it. Stages 1 and 2 keep the buffers whole, as slices of
one buffer of the whole flat order: after each optimizer step `gather_after_step` all-gathers it
once, so each replica holds the updated whole. Stage 3 (`shard="parameters"`) keeps only a copy
of this rank's range (`shard`); a bucket is whole only between `ensure_gathered` (an all-gather
into its buffer) and `release`.

Memory is given back by resizing the buffer's storage to zero, and at rest each parameter is a
stand-in of its shape holding one NaN, refused if read or written (`release`, at_rest.py). Both are needed: the parameters stay the same
`nn.Parameter` objects with their shapes (an optimizer or a hook holding one keeps a valid
reference; reading one at rest touches no freed memory), and a view autograd saved in forward (Linear saves its weight transposed)
points into the buffer itself, which a gather refills in place before backward reads it - FSDP
frees the same way, for the same reason. Reading a replica's weights at rest under stage 3
needs `whole()` (a collective), as `dp.full_state_dict()` and `dp.gathered_parameters()` do;
`load_state_dict` copies each rank's range alone, and `take_whole` each rank's range of an edit.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from phalanx.comm import AsyncComm, Tag
from phalanx.data.split import shard_sizes
from phalanx.data_parallel.buckets import Bucket
from phalanx.data_parallel.sharding.at_rest import stand_in, to_rest, to_whole
from phalanx.data_parallel.sharding.flat_layout import (FlatLayout, flatten_parameters, free_storage, memory_order_of,
                                               refill_storage)
from phalanx.errors import UsageError


class ShardedParameters:
    """The flat parameter buffers of `buckets`; `keep_whole` False is stage 3."""

    def __init__(self, buckets: Sequence[Bucket], *, layout: FlatLayout, rank: int, keep_whole: bool,
                 comm: AsyncComm, algorithm: str, steps: Callable[[], int]) -> None:
        self.buckets, self.layout, self.keep_whole = list(buckets), layout, keep_whole
        self._comm, self._algorithm, self._steps = comm, algorithm, steps
        self.owned = [layout.owned(b.index, rank) for b in self.buckets]
        self.counts = [layout.counts(b.index) for b in self.buckets]
        self.buffers, self.views, self.shard = [], [], []  # views: each parameter's whole, in its buffer
        self.gathered = [True] * len(self.buckets)
        self._held = 0  # open whole() blocks: nothing is released inside one (a forward there frees nothing)
        self._prefetched: dict[int, object] = {}  # bucket -> its all-gather in flight (stage 3)
        # Stages 1 and 2 keep every bucket's buffer a slice of one flat buffer of the whole order
        # (one dtype and device): this rank's ranges are then one range, and `gather_after_step`
        # is one all-gather, not one per bucket (each costs the communication thread's round trip).
        self.flat = _one_buffer(self.buckets, numel=layout.total) if keep_whole else None
        self._rank_counts = shard_sizes(layout.total, layout.world_size)  # each rank's share of the whole order
        # Bucket by bucket, so that set-up holds at most one bucket twice (its old parameters and
        # its flat buffer); this rank's range: a view where the whole stays, a copy where it goes.
        for index, (bucket, (lo, hi)) in enumerate(zip(self.buckets, self.owned)):
            start, stop = layout.bucket_ranges[index]
            flat, views = flatten_parameters(bucket, None if self.flat is None else self.flat[start:stop])
            self.buffers.append(flat)
            self.views.append(views)
            self.shard.append(flat[lo:hi] if keep_whole else flat[lo:hi].clone())
            self.release(index)

    def gather_after_step(self) -> None:
        """Stages 1 and 2, once the optimizer updated this rank's ranges: every replica whole
        again (one all-gather of the whole order; of each bucket where dtypes differ). Stage 3:
        what was gathered before the step is stale (`outdated`)."""
        if not self.keep_whole:
            self.outdated()
        elif self.flat is not None:
            self._comm.all_gather_async(self.flat, counts=self._rank_counts, algorithm=self._algorithm,
                                        tag=Tag("parameters", step=self._steps())).wait()
        elif self.keep_whole:
            for handle in [self._all_gather(index) for index in range(len(self.buckets))]:
                handle.wait()

    def refuse_replaced(self) -> None:
        """Before an optimizer step, stages 1 and 2: refuse a parameter whose `.data` the script
        replaced since prepare. It no longer views the flat buffer that the optimizer steps and the
        all-gather fills, so its values would stay as set while its range trained on unseen
        (shard="optimizer", SGD, 4 steps: 0.013 relative off one device, silently)."""
        if not self.keep_whole:
            return
        for bucket, views in zip(self.buckets, self.views):
            for param, view in zip(bucket.params, views):
                if param.data_ptr() != view.data_ptr():
                    raise UsageError(f"{self.layout.name_of(param)}.data was replaced after prepare(shard=...): the "
                                     "parameter no longer lies in the flat buffer the sharded optimizer steps, so it "
                                     "would not train; copy the values in instead (with torch.no_grad(): "
                                     "param.copy_(new)), or set them before prepare")

    def owned_flat(self) -> list[tuple[int, int, int]]:
        """(bucket index, start, stop) in the flat order of each bucket part this rank owns."""
        return [(b.index, self.layout.bucket_ranges[b.index][0] + lo, self.layout.bucket_ranges[b.index][0] + hi)
                for b, (lo, hi) in zip(self.buckets, self.owned) if hi > lo]

    def ensure_gathered(self, index: int) -> None:
        """Bucket `index`'s parameters whole on this rank (an all-gather unless they are; its
        prefetch's wait if one is in flight)."""
        if not self.gathered[index]:
            handle = self._prefetched.pop(index, None) or self._all_gather(index)
            handle.wait()
            for param, view in zip(self.buckets[index].params, self.views[index]):
                param.data = view
                to_whole(param)
            self.gathered[index] = True

    def prefetch(self, index: int) -> None:
        """Start bucket `index`'s all-gather now (stage 3), to be waited by `ensure_gathered` when a
        layer needs it; nothing if it is out of range, whole or already on its way. Every rank
        prefetches at the same points (the hooks are the same), so the collectives stay paired."""
        if 0 <= index < len(self.buckets) and not self.gathered[index] and index not in self._prefetched:
            self._prefetched[index] = self._all_gather(index)

    def outdated(self) -> None:
        """Stage 3, once this rank's ranges changed (an optimizer step, a load): a bucket still whole
        (a layer that did not run in the last forward kept it, as an evaluation skipping a training-only
        head does) and a prefetch still in flight (launched for a layer that did not run) hold the values
        before the change, and the next forward used them as they were. Each prefetch is waited (every
        rank launched it) and dropped, each whole bucket released; the next use gathers anew, on every
        rank alike (the hooks are the same everywhere). Inside `whole()` the buckets stay as they are."""
        for index, handle in list(self._prefetched.items()):
            handle.wait()
            free_storage(self.buffers[index])
        self._prefetched.clear()
        for index in range(len(self.buckets)):
            self.release(index)

    def check_outside_whole(self, what: str, way: str) -> None:
        """Refuse `what`, which changes this rank's ranges (a step, a load), inside `whole()` under
        stage 3: the block's whole parameters keep the values from before it, and what the block
        reads, a forward in it and `writeback=True` would use them (2 workers, float64: a step
        there left the weights read 0.13 and a forward 0.35 off the unsharded run, and a clamp kept
        by writeback undid the step)."""
        if self._held and not self.keep_whole:
            raise UsageError(f"{what} inside dp.gathered_parameters(): it changes each rank's range of the "
                             "parameters, which the block holds whole as they were before it (what it reads, a "
                             f"forward in it and writeback=True would use the old values); {way}")

    def release(self, index: int) -> None:
        """Stage 3: give bucket `index`'s whole back (this rank keeps its range); a no-op else.
        At rest a parameter keeps its shape but holds one NaN seen through zero strides
        (at_rest.py's `stand_in`): its shape and count stay true, reading it can touch no freed
        memory, and reading or writing it is refused in one line naming `dp.gathered_parameters()`."""
        if self.keep_whole or not self.gathered[index] or self._held:
            return
        for param, whole in zip(self.buckets[index].params, self.views[index]):
            param.data = stand_in(whole)
            to_rest(param, self.layout.name_of(param))
        free_storage(self.buffers[index])
        self.gathered[index] = False

    @contextlib.contextmanager
    def whole(self) -> Iterator[None]:
        """Every bucket whole for the block, released by nothing inside it (a forward), as it
        was after (a collective under stage 3)."""
        was = list(self.gathered)
        for index in range(len(self.buckets)):
            self.ensure_gathered(index)
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
            for index, kept in enumerate(was):
                if not kept:
                    self.release(index)

    def take_whole(self) -> None:
        """Inside `whole()`: this rank's range of each bucket as the whole now holds it (an edit kept)."""
        with torch.no_grad():
            for index, (lo, hi) in enumerate(self.owned):
                if not self.keep_whole:
                    self.shard[index].copy_(self.buffers[index][lo:hi])

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter whole, one bucket at a time: (name, whole parameter) for each, the
        bucket freed again before the next is gathered (stage 3). A collective: every rank must
        run it to the end; what it yields is valid until the next item."""
        for index, bucket in enumerate(self.buckets):
            was = self.gathered[index]
            self.ensure_gathered(index)
            for param, whole in zip(bucket.params, self.views[index]):
                yield self.layout.name_of(param), whole
            if not was:
                self.release(index)

    def _all_gather(self, index: int):
        flat, (lo, hi) = self.buffers[index], self.owned[index]
        if not self.keep_whole:
            refill_storage(flat)
            with torch.no_grad():
                flat[lo:hi].copy_(self.shard[index])
        return self._comm.all_gather_async(flat, counts=self.counts[index], algorithm=self._algorithm,
                                           tag=Tag("parameters", index, step=self._steps()))

    def load_state_dict(self, module: nn.Module, state: Mapping[str, torch.Tensor], *, strict: bool):
        """Stage 3's load: each parameter's range of this rank copied into its shard (no
        collective), the buffers loaded as usual. Returns torch's (missing, unexpected) keys."""
        self.check_outside_whole("dp.load_state_dict(...)", "load before the block, or inside it "
                                 "dp.module.load_state_dict(...) under writeback=True")
        names = {slot.name for slot in self.layout.slots}
        for slot in self.layout.slots:
            if slot.name not in state:
                continue
            lo, hi = self.owned[slot.bucket]
            start, stop = max(lo, slot.bucket_offset), min(hi, slot.bucket_offset + slot.numel)
            if stop <= start:
                continue
            value = state[slot.name]
            if tuple(value.shape) != slot.shape:
                raise RuntimeError(f"size mismatch for {slot.name}: copying a param with shape {tuple(value.shape)}, "
                                   f"the shape in current model is {slot.shape}")
            with torch.no_grad():
                self.shard[slot.bucket][start - lo:stop - lo].copy_(memory_order_of(
                    value, slot, device=self.shard[0].device)[start - slot.bucket_offset:stop - slot.bucket_offset])
        self.outdated()  # a bucket whole or on its way holds the values before the load
        result = module.load_state_dict({k: v for k, v in state.items() if k not in names}, strict=False)
        missing = [k for k in result.missing_keys if k not in names] + sorted(names - set(state))
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}: missing keys "
                               f"{missing}, unexpected keys {result.unexpected_keys}")
        return type(result)(missing, result.unexpected_keys)


def _one_buffer(buckets: Sequence[Bucket], *, numel: int) -> torch.Tensor | None:
    """A flat buffer of `numel` elements for every bucket's parameters back to back, or None
    where they differ in dtype or device (each bucket then has its own)."""
    kinds = {(b.buffer.dtype, b.buffer.device) for b in buckets}
    if len(kinds) != 1:
        return None
    dtype, device = kinds.pop()
    return torch.empty(numel, dtype=dtype, device=device)

