"""A shuffling DistributedSampler whose epoch never moves, said once under `phalanx run`.

torch's DistributedSampler draws each epoch's order from `seed + epoch`, and its epoch moves only
when the script calls `sampler.set_epoch(epoch)`. A DDP loop that forgets the call (torch's docs
warn of it; tutorials drop it; PyTorch-Ignite's Engine leaves it to a handler) reads the first
epoch's order in every epoch, on every rank, and nothing fails. `watching_sampler_epochs` follows,
while the script runs, each pass of a shuffling DistributedSampler to its end, counting the
optimizer steps taken meanwhile: a second training pass (one with a step in it) ended at the same
epoch is the forgotten call, and rank 0 warns once, at the line that read the pass's last batch
(its `for ... in loader:`). An evaluation loader's passes take no step, so a shuffling sampler over
a validation set, whose order does not matter, is left alone; so is a pass left before its end.
`phalanx.ShardedLoader` has no call to forget: `loader.epoch(e)` takes the epoch.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
import weakref
from typing import Iterator

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import DistributedSampler

from phalanx.errors import PACKAGE_DIR, PhalanxWarning, frame_outside

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def repeated_epoch_line(epoch: int) -> str:
    """What rank 0 says when a shuffling sampler ends a second training pass at epoch `epoch`."""
    return (f"this DistributedSampler (shuffle=True) ended a second training pass at epoch {epoch}: its set_epoch "
            "was not called, so every epoch reads the first epoch's order, on every rank; call "
            "sampler.set_epoch(epoch) at each epoch's start (the sampler's, not the DataLoader's), or use "
            "phalanx.ShardedLoader, whose loader.epoch(epoch) takes the epoch")


@contextlib.contextmanager
def watching_sampler_epochs(*, rank: int) -> Iterator[None]:
    """While held, follow each shuffling DistributedSampler's passes (module docstring); rank 0
    warns once. Every DistributedSampler's `__iter__` is wrapped, and put back after."""
    original = DistributedSampler.__iter__
    trained: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # sampler -> (epoch, training passes ended)
    steps, said = [0], [rank != 0]

    def count_step(optimizer, args, kwargs) -> None:
        steps[0] += 1

    def followed(sampler, indices: Iterator[int]) -> Iterator[int]:
        epoch, steps_before = sampler.epoch, steps[0]
        yield from indices
        if steps[0] == steps_before or said[0]:  # an evaluation's pass, or said already
            return
        ended_before, passes = trained.get(sampler, (None, 0))
        passes = passes + 1 if ended_before == epoch == sampler.epoch else 1
        trained[sampler] = (epoch, passes)
        if passes >= 2:
            said[0] = True
            frame = frame_outside((PACKAGE_DIR, _TORCH_DIR), start=sys._getframe(1))[0]
            warnings.warn_explicit(repeated_epoch_line(epoch), PhalanxWarning, frame.f_code.co_filename,
                                   frame.f_lineno)

    def passes(self):
        indices = original(self)
        return followed(self, indices) if self.shuffle and not said[0] else indices

    handle = register_optimizer_step_post_hook(count_step)
    DistributedSampler.__iter__ = passes
    try:
        yield
    finally:
        DistributedSampler.__iter__ = original
        handle.remove()
