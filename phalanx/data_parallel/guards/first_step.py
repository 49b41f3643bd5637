"""The first synced step looks at how the user's loop is written and names two DDP habits, once.

Habits that train wrong without an error, each caught on rank 0 at the
first synced step in which it ran a backward, and named in one `PhalanxWarning` with its fix:

- **A loss that did not come through `phalanx.shard_loss`.** phalanx *sums* gradients across
  ranks, so a per-rank mean loss (`F.cross_entropy(out, y)`, DDP's habit) gives k times the
  1-device gradient. While a check waits, `shard_loss` hooks the tensor it returns
  (`mark_shard_loss`): the hook runs during backward iff the backward passes through it, and
  tells every waiting check that backward's autograd task. Each check notes the tasks in which
  its parameters' gradients landed; none of them passed a `shard_loss`, but a backward ran: the
  warning. Matching by task, not by searching the loss's graph for the nearest parameters,
  keeps a GAN's generator right: its loss reaches it only through the discriminator's whole
  graph, and the discriminator's parameters are the nearest. A backward nested inside one that
  passed a `shard_loss` (reentrant activation checkpointing: `checkpoint(model, x,
  use_reentrant=True)`) counts as passed: the hook keeps a count of such backwards under way
  until autograd's end-of-backward callback.
- **`shard_loss(loss_sum, len(x))`**: the shard's size where the *global* batch size belongs
  (each rank's sum divided by its own count: the per-rank mean again, k times the gradient).
  While a check waits, the replica notes the rows of each forward's first tensor argument and
  `shard_loss` its `global_batch_size`: equal on rank 0 with k > 1 is the warning. (A language
  model's own token count, `ids.numel()`, needs every rank's view to tell from a correct global
  count that equals it by chance; sizes.py judges it, and a size that differs between the ranks.)
- **torch's `DistributedSampler`** in the frames of the loop that called
  `finish_gradient_sync()` (its locals, and the script's globals): it pads the dataset to a
  multiple of the ranks by repeating examples (or drops some), so an epoch is not the 1-device
  epoch; `ShardedLoader` splits every global batch exactly.

Whether a backward ran is learned from gradient hooks on the parameters, registered only until
the check is done; afterwards nothing of this runs, so the steady-state step is unchanged.
Nothing here communicates: rank 0 checks alone.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from types import FrameType

import torch
from torch import nn

from phalanx.data.loader import distributed_sampler_note, samplers_in_frames
from phalanx.errors import PhalanxWarning
from phalanx.data_parallel.replica_hook import ReplicaHook
from phalanx.data_parallel.guards.sizes import note_size


# The checks that wait to see a backward through shard_loss (rank 0's, until its first synced step).
_WAITING: weakref.WeakSet = weakref.WeakSet()
_UNDER_WAY = [0]  # backwards that passed a shard_loss result and have not ended (nested ones run inside)


def mark_shard_loss(scaled: torch.Tensor, global_batch_size=None, loss_sum: torch.Tensor | None = None) -> None:
    """Called by shard_loss with its result: while a check waits, a backward through
    `scaled` tells it in which autograd task it ran, and the size it was given is set beside the
    rows of the last forward; during a checked step the size is noted for the ranks' comparison
    (sizes.py). Neither: one test each."""
    if loss_sum is not None:
        note_size(global_batch_size, loss_sum)
    if _WAITING and scaled.requires_grad:
        scaled.register_hook(_passed)
        for check in list(_WAITING):
            check.sizes_given.append((global_batch_size, check.rows_forwarded))


def _passed(grad: torch.Tensor) -> None:
    """Gradient hook shard_loss puts on its result: this backward came through it."""
    task = torch._C._current_graph_task_id()
    for check in list(_WAITING):
        check.shard_loss_tasks.add(task)
    _UNDER_WAY[0] += 1
    torch.autograd.Variable._execution_engine.queue_callback(_ended)


def _ended() -> None:
    _UNDER_WAY[0] -= 1


def shard_size_message(global_batch_size: int, world_size: int) -> str:
    return (f"phalanx.shard_loss got global_batch_size={global_batch_size}, the number of examples this rank's "
            f"forward just saw: the global batch size is their sum over the {world_size} ranks (ShardedLoader "
            "yields it beside each shard); "
            f"divided by the shard's own size the summed gradient is about {world_size}x the 1-device gradient")


def loss_scale_message(world_size: int) -> str:
    return (f"this step's backward did not come through phalanx.shard_loss: gradients are summed over the "
            f"{world_size} ranks, so a per-rank mean loss gives {world_size}x the 1-device gradient (with SGD: "
            f"the run with lr x {world_size}); backpropagate phalanx.shard_loss(loss_sum, global_batch_size), or build the replica "
            "with average=True for DDP's mean of per-rank means (exact only for equal shards)")


class FirstStepCheck:
    """Rank 0's one-time look at the first synced step with a backward; see the module docstring."""

    def __init__(self, params: list[nn.Parameter], *, world_size: int, check_loss: bool,
                 module: nn.Module | None = None) -> None:
        self.world_size, self.check_loss = world_size, check_loss
        self.shard_loss_tasks: set[int] = set()  # autograd tasks (backwards) that passed a shard_loss result
        self.landed_tasks: set[int] = set()  # those in which a gradient of these parameters landed
        self.rows_forwarded: int | None = None  # the first dimension of the last forward's first tensor
        self.sizes_given: list[tuple] = []  # shard_loss's size, the rows just before
        params = [p for p in params if p.requires_grad]  # a frozen parameter gets no gradient, takes no hook
        self._handles = [p.register_post_accumulate_grad_hook(ReplicaHook(self._landed)) for p in params]
        if module is not None and check_loss:
            self._handles.append(module.register_forward_pre_hook(ReplicaHook(self._forwarded), with_kwargs=True))
        if check_loss:
            _WAITING.add(self)

    @property
    def backward_ran(self) -> bool:
        return bool(self.landed_tasks)

    @property
    def through_shard_loss(self) -> int:
        """How many backwards that reached these parameters passed through a shard_loss result."""
        return len(self.landed_tasks & self.shard_loss_tasks)

    def _forwarded(self, module, args, kwargs) -> None:
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        self.rows_forwarded = first.shape[0] if first is not None and first.dim() > 0 else None

    def _landed(self, param: nn.Parameter) -> None:
        task = torch._C._current_graph_task_id()
        self.landed_tasks.add(task)
        if _UNDER_WAY[0]:  # a backward nested in one through shard_loss (reentrant checkpointing)
            self.shard_loss_tasks.add(task)

    def after_sync(self, caller: FrameType | None) -> bool:
        """Warn about what the step shows; True when the check is done (a backward ran)."""
        if not self.backward_ran:
            return False
        messages = []
        if self.check_loss and self.through_shard_loss == 0:
            messages.append(loss_scale_message(self.world_size))
        # Below k examples one rank may hold them all (its rows are the global size): not judged.
        k = self.world_size
        own = next((size for size, rows in self.sizes_given if size is not None and size == rows and size >= k), None)
        if self.check_loss and self.through_shard_loss and own is not None:
            messages.append(shard_size_message(own, k))
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
        _WAITING.discard(self)


def _sampler_in_frames(frame: FrameType | None) -> str | None:
    """The note for the first padding/dropping DistributedSampler (or DataLoader using one) that
    a frame from `frame` upwards holds in its locals, or the script's globals; None if none."""
    notes = (distributed_sampler_note(sampler) for _, sampler in samplers_in_frames(frame))
    return next((note for note in notes if note is not None), None)


def caller_frame(depth: int) -> FrameType | None:
    """The frame `depth` levels above the caller of this function's caller (None if too deep)."""
    try:
        return sys._getframe(depth + 1)
    except ValueError:
        return None
