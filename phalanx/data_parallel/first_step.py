"""The first synced step looks at how the user's loop is written and names two DDP habits, once.

Habits that train wrong without an error (issue 22, cases 2 and 3), each caught on rank 0 at the
first synced step in which it ran a backward, and named in one `PhalanxWarning` with its fix:

- **A loss that did not come through `phalanx.shard_loss`.** phalanx *sums* gradients across
  ranks, so a per-rank mean loss (`F.cross_entropy(out, y)`, DDP's habit) gives k times the
  1-device gradient. `shard_loss` registers a gradient hook on the tensor it returns while a
  check is waiting (`ShardLossMarks`): the hook runs during backward iff the backward passed
  through it. No marks since the replica was built, but a backward ran: the warning.
- **torch's `DistributedSampler`** in the frames of the loop that called
  `finish_gradient_sync()` (its locals, and the script's globals): it pads the dataset to a
  multiple of the ranks by repeating examples (or drops some), so an epoch is not the 1-device
  epoch; `ShardedLoader` splits every global batch exactly.

Whether a backward ran is learned from gradient hooks on the parameters, registered only until
the check is done; afterwards nothing of this runs, so the steady-state step is unchanged.
Nothing here communicates: rank 0 checks alone, the other ranks build no check at all.
"""

from __future__ import annotations

import sys
import warnings
from types import FrameType

import torch
from torch import nn

from phalanx.data.loader import distributed_sampler_note
from phalanx.errors import PhalanxWarning

# How many frames above finish_gradient_sync to search for a DistributedSampler: the user's loop
# is the caller, or a few frames up when the step runs through train_batch / a helper.
_FRAMES_SEARCHED = 8


class ShardLossMarks:
    """Process-wide count of backwards that went through `shard_loss` (a count, not distributed
    state: the hook has no way to reach a replica, and a process trains one model at a time)."""

    def __init__(self) -> None:
        self.count = 0
        self.watchers = 0  # checks waiting: while 0, shard_loss registers no hook (zero cost)

    def note(self, scaled: torch.Tensor) -> None:
        """Called by shard_loss on the tensor it returns."""
        if self.watchers and scaled.requires_grad:
            scaled.register_hook(self._passed)

    def _passed(self, grad: torch.Tensor) -> None:
        self.count += 1


SHARD_LOSS_MARKS = ShardLossMarks()


def loss_scale_message(world_size: int) -> str:
    return (f"this step's backward did not come through phalanx.shard_loss: gradients are summed over the "
            f"{world_size} ranks, so a per-rank mean loss gives {world_size}x the 1-device gradient (with SGD: "
            f"the run with lr x {world_size}); backpropagate phalanx.shard_loss(loss_sum, global_batch_size), or build the replica "
            "with average=True for DDP's mean of per-rank means (exact only for equal shards)")


class FirstStepCheck:
    """Rank 0's one-time look at the first synced step with a backward; see the module docstring."""

    def __init__(self, params: list[nn.Parameter], *, world_size: int, check_loss: bool) -> None:
        self.world_size, self.check_loss = world_size, check_loss
        self.marks_at_start = SHARD_LOSS_MARKS.count
        self.backward_ran = False
        self._handles = [p.register_post_accumulate_grad_hook(self._landed) for p in params]
        self._watching = check_loss
        if check_loss:
            SHARD_LOSS_MARKS.watchers += 1

    def _landed(self, param: nn.Parameter) -> None:
        self.backward_ran = True

    def after_sync(self, caller: FrameType | None) -> bool:
        """Warn about what the step shows; True when the check is done (a backward ran)."""
        if not self.backward_ran:
            return False
        messages = []
        if self.check_loss and SHARD_LOSS_MARKS.count == self.marks_at_start:
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
        if self._watching:
            SHARD_LOSS_MARKS.watchers -= 1
            self._watching = False


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
