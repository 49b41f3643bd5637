"""The first synced step looks at how the user's loop is written and names two DDP habits, once.

Habits that train wrong without an error, each caught on rank 0 at the
first synced step in which it ran a backward, and named in one `PhalanxWarning` with its fix:

- **A loss that did not come through `phalanx.shard_loss`.** phalanx *sums* gradients across
  ranks, so a per-rank mean loss (`F.cross_entropy(out, y)`, DDP's habit) gives k times the
  1-device gradient. While the check waits, it holds its parameters' gradient accumulators (the
  autograd nodes every backward through them ends in, as DDP holds them) with itself in their
  `Node.metadata`; `shard_loss` looks a few nodes down its loss's graph (`mark_shard_loss`) and,
  where it meets one, hooks the tensor it returns to the check: the hook runs during backward
  iff the backward passed through it. None passed since the replica was built, but a backward
  ran: the warning. No process-wide record: the loss's own graph leads to the check.
- **torch's `DistributedSampler`** in the frames of the loop that called
  `finish_gradient_sync()` (its locals, and the script's globals): it pads the dataset to a
  multiple of the ranks by repeating examples (or drops some), so an epoch is not the 1-device
  epoch; `ShardedLoader` splits every global batch exactly.

Whether a backward ran is learned from gradient hooks on the parameters, registered only until
the check is done; afterwards nothing of this runs, so the steady-state step is unchanged.
Nothing here communicates: rank 0 checks alone, the other ranks build no check at all.
"""

from __future__ import annotations

import collections
import sys
import warnings
import weakref
from types import FrameType

import torch
from torch import nn

from phalanx.data.loader import distributed_sampler_note
from phalanx.errors import PhalanxWarning

# How many frames above finish_gradient_sync to search for a DistributedSampler: the user's loop
# is the caller, or a few frames up when the step runs through train_batch / a helper.
_FRAMES_SEARCHED = 8


_CHECK_KEY = "phalanx.first_step"  # in a gradient accumulator's Node.metadata: a weakref to its check
# A bound on the autograd nodes shard_loss looks at below its loss. The parameters nearest a
# loss are its model's last layer's: 4 nodes under a cross-entropy sum, 16 with label smoothing
# and bf16-mixed's casts (prepare's models); 64 leaves room for a user's longer loss.
_NODES_SEARCHED = 64
_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad


def pending_check(loss: torch.Tensor) -> FirstStepCheck | None:
    """The first-step check waiting on the parameters `loss` is computed from, or None. Breadth
    first from `loss`, to the first parameter's gradient accumulator: a check marks every one of
    its replica's, so the nearest tells; once no check is pending, a step pays only the few nodes
    between its loss and its last layer (microseconds)."""
    queue, seen = collections.deque([loss.grad_fn] if loss.grad_fn is not None else []), 0
    while queue and seen < _NODES_SEARCHED:
        node = queue.popleft()
        seen += 1
        if type(node) is _ACCUMULATE_GRAD:
            ref = node.metadata.get(_CHECK_KEY)
            return None if ref is None else ref()
        queue.extend([child for child, _ in node.next_functions if child is not None])
    return None


def mark_shard_loss(loss_sum: torch.Tensor, scaled: torch.Tensor) -> None:
    """Called by shard_loss with its input and result: where a check waits on the parameters the
    loss comes from, a backward through `scaled` tells it so."""
    check = pending_check(loss_sum)
    if check is not None:
        scaled.register_hook(check.passed)


def loss_scale_message(world_size: int) -> str:
    return (f"this step's backward did not come through phalanx.shard_loss: gradients are summed over the "
            f"{world_size} ranks, so a per-rank mean loss gives {world_size}x the 1-device gradient (with SGD: "
            f"the run with lr x {world_size}); backpropagate phalanx.shard_loss(loss_sum, global_batch_size), or build the replica "
            "with average=True for DDP's mean of per-rank means (exact only for equal shards)")


class FirstStepCheck:
    """Rank 0's one-time look at the first synced step with a backward; see the module docstring."""

    def __init__(self, params: list[nn.Parameter], *, world_size: int, check_loss: bool) -> None:
        self.world_size, self.check_loss = world_size, check_loss
        self.through_shard_loss = 0  # backwards that passed through a shard_loss result
        self.backward_ran = False
        params = [p for p in params if p.requires_grad]  # a frozen parameter gets no gradient, takes no hook
        self._handles = [p.register_post_accumulate_grad_hook(self._landed) for p in params]
        self._accumulators = []
        if check_loss:
            with torch.enable_grad():  # held, every graph through a parameter ends in this same node
                self._accumulators = [p.view_as(p).grad_fn.next_functions[0][0] for p in params]
            for node in self._accumulators:
                node.metadata[_CHECK_KEY] = weakref.ref(self)

    def passed(self, grad: torch.Tensor) -> None:
        """Gradient hook shard_loss puts on its result: this backward came through it."""
        self.through_shard_loss += 1

    def _landed(self, param: nn.Parameter) -> None:
        self.backward_ran = True

    def after_sync(self, caller: FrameType | None) -> bool:
        """Warn about what the step shows; True when the check is done (a backward ran)."""
        if not self.backward_ran:
            return False
        messages = []
        if self.check_loss and self.through_shard_loss == 0:
            messages.append(loss_scale_message(self.world_size))
        sampler_note = _sampler_in_frames(caller)
        if sampler_note is not None:
            messages.append(sampler_note)
        self.close()
        for message in messages:
            warnings.warn(message, PhalanxWarning, stacklevel=4)
        return True

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for node in self._accumulators:
            node.metadata.pop(_CHECK_KEY, None)
        self._accumulators = []


def _sampler_in_frames(frame: FrameType | None) -> str | None:
    """The note for the first padding/dropping DistributedSampler (or DataLoader using one) that
    a frame from `frame` upwards holds in its locals, or the script's globals; None if none."""
    for _ in range(_FRAMES_SEARCHED):
        if frame is None:
            return None
        scopes = [frame.f_locals]
        if frame.f_globals.get("__name__") == "__main__":
            scopes.append(frame.f_globals)
        for scope in scopes:
            for value in list(scope.values()):
                note = distributed_sampler_note(value)
                if note is not None:
                    return note
        frame = frame.f_back
    return None


def caller_frame(depth: int) -> FrameType | None:
    """The frame `depth` levels above the caller of this function's caller (None if too deep)."""
    try:
        return sys._getframe(depth + 1)
    except ValueError:
        return None
