"""What a DistributedSampler's passes show under `phalanx run`, said once each on rank 0.

torch's DistributedSampler draws each epoch's order from `seed + epoch`, and its epoch moves only
when the script calls `sampler.set_epoch(epoch)`. A DDP loop that forgets the call (torch's docs
warn of it; tutorials drop it; PyTorch-Ignite's Engine leaves it to a handler) reads the first
epoch's order in every epoch, on every rank, and nothing fails. And a sampler whose dataset does not
divide by the ranks pads it by repeating examples (or drops some, `drop_last=True`) so that each
rank gets an equal share: an evaluation over it counts some examples twice (or never), and its
metrics summed over the ranks are not one device's.

`watching_sampler_passes` follows, while the script runs, each pass of a shuffling or uneven
DistributedSampler, counting the optimizer steps taken meanwhile, and judges it when its last index
is drawn (a loop that knows its length, as Lightning's, never asks past it). A second training pass
(one with a step in it) read to its end at the same epoch is the forgotten call; a pass without a
step, read with gradients off (`torch.no_grad()`, `inference_mode`), over an uneven sampler is an
evaluation that repeats or skips examples. Rank 0 warns once each, at the line that read the pass's
last batch (its `for ... in loader:`; where a library's loop read it, the script's line that called
the library, naming the library's). A shuffling sampler over a validation set, whose order does
not matter, is left alone, and so is a pass left before its end; a pass of one batch, or whose last
indices a DataLoader's workers drew before its first step, counts as no training pass.
`phalanx.ShardedLoader` has no call to forget (`loader.epoch(e)` takes the epoch), and
`phalanx.evaluate_dataset` counts every example once.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
import weakref
from typing import Iterator

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import DistributedSampler

from phalanx.data.loader import uneven
from phalanx.errors import PhalanxWarning, script_line

def repeated_epoch_line(epoch: int) -> str:
    """What rank 0 says when a shuffling sampler reaches the end of a second training pass at epoch `epoch`."""
    return (f"this DistributedSampler (shuffle=True) reached the end of a second training pass at epoch {epoch}: its "
            "set_epoch was not called, so every epoch reads the first epoch's order, on every rank; call "
            "sampler.set_epoch(epoch) at each epoch's start (the sampler's, not the DataLoader's), or use "
            "phalanx.ShardedLoader, whose loader.epoch(epoch) takes the epoch")


def uneven_evaluation_line(sampler: DistributedSampler) -> str:
    """What rank 0 says when an evaluation's pass over an uneven `sampler` reaches its end."""
    examples, read, ranks = len(sampler.dataset), sampler.total_size, sampler.num_replicas
    what = (f"reads {read - examples} of its {examples} examples twice (it pads them to {read} so that {ranks} ranks "
            "get equal shares)" if read > examples else
            f"leaves {examples - read} of its {examples} examples out (drop_last=True)")
    return (f"this DistributedSampler reached the end of an evaluation's pass (no optimizer step, gradients off) that "
            f"{what}, so metrics summed over the ranks are not one device's (DDP's evaluation does the same); evaluate with "
            "phalanx.evaluate_dataset(model, dataset, world=world), which counts every example once")


@contextlib.contextmanager
def watching_sampler_passes(*, rank: int) -> Iterator[None]:
    """While held, follow each shuffling or uneven DistributedSampler's passes (module docstring);
    rank 0 warns once of each finding. Every DistributedSampler's `__iter__` is wrapped, and put back after."""
    original = DistributedSampler.__iter__
    trained: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # sampler -> (epoch, training passes ended)
    steps, said = [0], {"epoch": rank != 0, "uneven": rank != 0}

    def count_step(optimizer, args, kwargs) -> None:
        steps[0] += 1

    def say(line: str) -> None:
        path, line_number, note = script_line(sys._getframe(3))
        warnings.warn_explicit(line + note, PhalanxWarning, path, line_number)

    def followed(sampler, indices: Iterator[int]) -> Iterator[int]:
        epoch, steps_before, last = sampler.epoch, steps[0], sampler.num_samples - 1
        for drawn, index in enumerate(indices):
            if drawn == last:  # its last batch is being read: judged now (a loop that knows its length asks no more)
                judge(sampler, epoch, stepped=steps[0] > steps_before)
            yield index

    def judge(sampler, epoch: int, *, stepped: bool) -> None:
        if not stepped:  # an evaluation's pass, if gradients are off
            if not torch.is_grad_enabled() and uneven(sampler) and not said["uneven"]:
                said["uneven"] = True
                say(uneven_evaluation_line(sampler))
            return
        ended_before, passes = trained.get(sampler, (None, 0))
        passes = passes + 1 if ended_before == epoch == sampler.epoch else 1
        trained[sampler] = (epoch, passes)
        if passes >= 2 and sampler.shuffle and not said["epoch"]:
            said["epoch"] = True
            say(repeated_epoch_line(epoch))

    def passes(self):
        indices = original(self)
        # A subclass that keeps none of torch's attributes (epoch, shuffle, num_samples) is not followed.
        if not all(isinstance(getattr(self, name, None), kind) for name, kind in
                   (("epoch", int), ("shuffle", bool), ("num_samples", int))):
            return indices
        followed_now = (self.shuffle and not said["epoch"]) or (uneven(self) and not said["uneven"])
        return followed(self, indices) if followed_now else indices

    handle = register_optimizer_step_post_hook(count_step)
    DistributedSampler.__iter__ = passes
    try:
        yield
    finally:
        DistributedSampler.__iter__ = original
        handle.remove()
