"""Overlapping the gradient exchange with backward: which bucket launches when, and the one wait.

`OverlapScheduler` owns every bucket's in-flight allreduce handle. A post-accumulate-grad hook on
each parameter tells it when that parameter's gradient has landed in its bucket (`mark_ready`);
when a bucket's last gradient of this backward has landed, its allreduce is launched at once,
while autograd goes on computing earlier layers' gradients - the scheme of torch DDP's reducer
(`Reducer::mark_variable_ready` / `mark_bucket_ready`) and picotron's `BucketManager`.
`finish()` is the single wait point after backward: it launches whatever never became ready
(unused parameters, a rank whose shard was empty and ran no backward at all) and waits every
handle exactly once. It knows nothing about processes: `launch` is any callable that starts an
allreduce of a bucket and returns a handle (`AsyncComm.allreduce_async` in training, a fake in
unit tests), and whether to sync at all (`no_sync`) is decided by the caller.

A second backward in one synced step, each through its own forward (DCGAN's discriminator on real,
then on fake images), would land gradients in buckets already on the wire. The replica calls
`settle()` at the second forward: every bucket is summed now, the sums set aside and the buckets
zeroed, so the next backward's gradients go out on their own, and `finish()` adds the sums back.
DDP waits every bucket at the end of each backward and averages again, which works for its mean
of means; a sum of sums would count the first backward k times, so phalanx keeps it apart. A
second backward through the same forward (`retain_graph=True`), or of two forwards run before
either backward (a siamese pair's "forward a, forward b, backward a, backward b"), has no forward
to settle at and stays refused, naming both and the fixes (one backward of the summed losses,
overlap=False, or the first backward under `no_sync()`). DDP runs the latter without a word,
and its gradients are not one process's (0.14 apart on a 5-8-3 MLP, 2 gloo ranks, torch 2.13).

Reentrant activation checkpointing (`checkpoint(fn, x, use_reentrant=True)`, the default of many
libraries) runs each checkpointed segment's backward as a backward of its own, so a parameter used
in several segments (ALBERT's one layer, a block applied twice) lands once per segment in one
backward. DDP refuses it ("marked ready twice") unless told `static_graph=True`, which counts the
landings of its first iteration. The scheduler learns the same without being told: during the
first synced backward it looks, at each landing, whether that landing runs inside checkpoint's
reentrant backward; from the first that does, it launches nothing more in that step and counts
every parameter's landings, and from then on a bucket launches once each of its parameters landed
as often as then (one that lands fewer times goes out at `finish()`, as an unused one). A landing
beyond that count, once its bucket went out, is refused naming the parameter and the fixes.

Hooks run on autograd's engine thread for the parameters' device; with one device per process
that is one thread, so this class needs no lock.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Protocol, Sequence

import torch
from torch import nn

from phalanx.data_parallel.buckets import Bucket
from phalanx.data_parallel.replica_hook import ReplicaHook


class PendingHandle(Protocol):
    """What a launch returns: `phalanx.comm.Handle` (or a test's fake)."""

    @property
    def waited(self) -> bool: ...

    def wait(self) -> object: ...


class OverlapScheduler:
    """Launch bucket i's allreduce once its gradients have all landed and buckets < i launched."""

    def __init__(self, buckets: Sequence[Bucket], *, launch: Callable[[Bucket], PendingHandle],
                 max_in_flight: int | None = None, module: nn.Module | None = None) -> None:
        """`max_in_flight`: at most this many launched, unwaited buckets; a launch beyond it
        first waits the oldest (a sharded replica frees a bucket's buffer at its wait). None:
        every handle is waited in `finish()`."""
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1 (or None), got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.buckets = list(buckets)
        if [b.index for b in self.buckets] != list(range(len(self.buckets))):
            raise ValueError(f"bucket indices must be 0..{len(self.buckets) - 1} in order, got {[b.index for b in self.buckets]}")
        self._launch_fn = launch
        self._bucket_of: dict[int, int] = {}  # id(param) -> bucket index
        for bucket in self.buckets:
            for param in bucket.params:
                self._bucket_of[id(param)] = bucket.index
        self._landed: list[dict[int, int]] = [{} for _ in self.buckets]  # id(param) -> landings this backward
        self._done = [0] * len(self.buckets)  # each bucket's parameters that landed as often as expected
        self._expected: dict[int, int] = {}  # id(param) -> landings per backward, where learned above 1
        self._watching = True  # until the first synced backward is summed: looking for reentrant checkpointing
        self._learning = False  # that backward runs reentrant checkpointing: launch nothing, count (docstring)
        self._module = module  # for a refusal's parameter name
        self._handles: list[PendingHandle | None] = [None] * len(self.buckets)
        self._next_launch = 0  # buckets [0, _next_launch) have launched in this step
        self._next_wait = 0  # buckets [0, _next_wait) have been waited in this step
        self._started = False  # a gradient landed in this step
        self._carried: list | None = None  # the sums of this step's settled backwards, set aside (settle())
        self._carry_kept: list = []  # their buffers, kept from step to step once a loop settles

    @property
    def started(self) -> bool:
        """True once a gradient landed in this step, until `finish()` or `reset()`."""
        return self._started

    @property
    def in_flight(self) -> bool:
        """True between the first launch of a step and the end of `finish()`."""
        return self._next_launch > 0

    def mark_ready(self, param: nn.Parameter) -> None:
        """Called after each accumulation of a parameter's gradient in a synced backward."""
        index = self._bucket_of[id(param)]
        landed = self._landed[index]
        if self._watching and not self._learning and in_reentrant_backward():
            self._learning = True
        count, expected = landed.get(id(param), 0) + 1, self._expected.get(id(param), 1)
        if self._handles[index] is not None or (count > expected and not self._learning):
            # The bucket's buffer is (or is about to be) on the wire: a second gradient for it
            # would race with the allreduce, so refuse loudly (DDP: "marked ready twice").
            raise self._twice(index, param)
        self._started = True
        landed[id(param)] = count
        if count == expected:
            self._done[index] += 1
            if self._done[index] == len(self.buckets[index].params) and not self._learning:
                self._launch_ready_in_order()

    def _twice(self, index: int, param: nn.Parameter) -> RuntimeError:
        name = next((n for n, p in self._module.named_parameters() if p is param), None) if self._module else None
        what = f"{name}'s gradient" if name else "a gradient"
        if in_reentrant_backward():
            return RuntimeError(
                f"{what} landed again after its bucket {index} went out, inside the backward of reentrant activation "
                "checkpointing (torch.utils.checkpoint with use_reentrant=True), which runs each checkpointed "
                "segment's backward on its own: the parameter is used in more segments than in the first synced "
                "step, or outside one and inside another; pass use_reentrant=False (torch's advice), or prepare "
                "with overlap=False")
        return RuntimeError(
            f"{what} landed twice in bucket {index} during one synced step: two backwards with no forward "
            "between them - of two forwards run before either backward (forward a, forward b, backward a, "
            "backward b), or of one forward (retain_graph=True) - or two backwards of a sharded replica, before "
            "finish_gradient_sync, while the first one's buckets were on the wire; add the losses and call "
            "backward once, or run each backward right after its own forward, or prepare with overlap=False, or "
            "call the first backward under dp.no_sync()")

    def _launch_ready_in_order(self) -> None:
        # Launch strictly in bucket order, even when a later bucket is complete first. Backends
        # pair the k-th collective of one rank with the k-th of every other rank; the order in
        # which buckets complete can differ between ranks (unused parameters, an empty shard,
        # autograd's scheduling), so launching as they complete could sum bucket 1 on one rank
        # with bucket 2 on another - wrong numbers or a hang. DDP's reducer does the same:
        # "Buckets are reduced in sequence" (`next_bucket_` in reducer.cpp).
        while self._next_launch < len(self.buckets) and self._is_complete(self._next_launch):
            self._launch(self._next_launch)

    def _is_complete(self, index: int) -> bool:
        return self._done[index] == len(self.buckets[index].params) and not self._learning

    def _launch(self, index: int) -> None:
        assert index == self._next_launch, (index, self._next_launch)
        while self.max_in_flight is not None and self._next_launch - self._next_wait >= self.max_in_flight:
            self._wait(self._next_wait)
        assert self._handles[index] is None, f"bucket {index} launched twice in one step"
        handle = self._launch_fn(self.buckets[index])
        assert not handle.waited, f"bucket {index}: a fresh handle is already waited"
        self._handles[index] = handle
        self._next_launch += 1

    def finish(self) -> None:
        """Launch every bucket still unlaunched (in order), then wait each handle exactly once;
        then add back the sums `settle()` set aside.

        A bucket whose parameters got no gradient this backward still holds what zero_grad and
        any no_sync micro-batches left in it (zeros for a rank that ran no backward); it is
        summed all the same, so every rank issues the same collectives in the same order.
        """
        try:
            self._sum_all()
            for bucket, carried in zip(self.buckets, self._carried or ()):
                bucket.buffer.add_(carried)
        finally:
            self.reset()

    def settle(self) -> None:
        """Sum this step's backwards so far (as `finish()`, every bucket in order) and set the sums
        aside, the buckets zeroed for the next backward; `finish()` adds them back. On every rank
        at the same point (a collective): the replica calls it from a forward after a synced
        backward's gradients began landing."""
        try:
            self._sum_all()
        except BaseException:
            self.reset()
            raise
        if self._carried is None:
            if len(self._carry_kept) != len(self.buckets):
                self._carry_kept = [torch.empty_like(bucket.buffer) for bucket in self.buckets]
            self._carried = self._carry_kept
            for kept, bucket in zip(self._carried, self.buckets):
                kept.copy_(bucket.buffer)
        else:  # a third backward, or more
            for kept, bucket in zip(self._carried, self.buckets):
                kept.add_(bucket.buffer)
        for bucket in self.buckets:
            bucket.buffer.zero_()
        carried = self._carried
        self.reset()
        self._carried = carried

    def _sum_all(self) -> None:
        """Launch what has not launched, in order, and wait every handle once; what a learning
        backward counted is kept (module docstring)."""
        if self._learning:
            for landed in self._landed:
                self._expected.update((pid, count) for pid, count in landed.items() if count > 1)
        self._learning = False
        self._watching = self._watching and not self._started
        while self._next_launch < len(self.buckets):
            self._launch(self._next_launch)
        while self._next_wait < len(self.buckets):
            self._wait(self._next_wait)

    def _wait(self, index: int) -> None:
        """Wait bucket `index`'s handle, the one wait of each (buckets are waited in order)."""
        assert index == self._next_wait, (index, self._next_wait)
        handle = self._handles[index]
        assert handle is not None, f"bucket {index} never launched"
        assert not handle.waited, f"bucket {index}: handle waited before finish() (or the in-flight bound) waited it"
        self._next_wait += 1
        handle.wait()
        assert handle.waited, f"bucket {index}: handle not marked waited after wait()"

    def reset(self) -> None:
        """Forget this step's state (after finish, or after a failed step)."""
        for landed in self._landed:
            landed.clear()
        self._done = [0] * len(self.buckets)
        self._learning = False
        self._handles = [None] * len(self.buckets)
        self._next_launch = self._next_wait = 0
        self._started, self._carried = False, None


def landing_hooks(buckets: Sequence[Bucket], on_landed: Callable[[nn.Parameter], None], *,
                  every_parameter: bool) -> list:
    """Register `on_landed(param)` to run after autograd accumulated a backward's gradient of a
    bucket's parameter (torch >= 2.1's post-accumulate-grad hook): on every parameter to overlap
    (a bucket launches once all of its have landed), or on one per bucket when only the
    forgotten-sync guard needs to see that a backward ran. Returns the handles to remove; a deep copy
    of the module keeps none of them (replica_hook.py)."""
    return [param.register_post_accumulate_grad_hook(ReplicaHook(on_landed))
            for bucket in buckets for param in (bucket.params if every_parameter else bucket.params[:1])]


def unhooked(handles: Sequence) -> list:
    """Remove every hook of `handles` (landing_hooks' and the like); an empty list, to hold instead."""
    for handle in handles:
        handle.remove()
    return []


_CHECKPOINT_FILE = os.path.join("torch", "utils", "checkpoint.py")


def in_reentrant_backward() -> bool:
    """Whether this landing runs inside reentrant activation checkpointing's backward (a frame of
    torch.utils.checkpoint's `backward` on the stack); looked for only in the first synced backward."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "backward" and frame.f_code.co_filename.endswith(_CHECKPOINT_FILE):
            return True
        frame = frame.f_back
    return False
