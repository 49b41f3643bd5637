"""Gradients carried into the next step without zero_grad: summed once, as on one device.

On one device a backward adds into whatever `.grad` holds, so a script that does not zero the
gradients between optimizer steps (a forgotten zero_grad, `zero_grad()` every N steps,
accumulating across steps) steps with g_old + g_new. After a sync every rank's buckets hold the
same summed g_old; were each rank's next backward to add its share on top, the next sum would
count g_old once per rank. So the carried sum is kept once: just before the next backward's first
gradient is added into a slot (a tensor hook, which autograd runs before it accumulates), rank 0
keeps its buckets and every other rank zeroes its own; under `shard="optimizer"` each rank keeps
the range its reduce-scatter returns to it and zeroes the rest. Stages 2 and 3 add each
reduce-scatter into the shard gradient, which only zero_grad zeroes (sharding/stages.py).

With `average=True` (DDP's mean of per-rank means) one device steps with g_old + mean(new), and
the sum is divided by k after the exchange: unsharded, every rank keeping g_old gives k g_old +
sum(new), right, with nothing to do here; under `shard="optimizer"` each rank's kept range is
multiplied by k (`scale`) as it opens; stages 2 and 3 divide each reduce-scatter as they add it.
(Before 2026-12-02 the last two divided g_old by k too: 0.45 off one device after 4 SGD steps.)

A sparse gradient (sparse.py) is its zeroed slot again on the ranks that zero; the rows noted
stay, and rank 0's union covers g_old's.

The hooks exist only from a forward (grad enabled) after a sync that no zero_grad followed to that
backward's first gradient: a loop that zeroes each step, through `dp.zero_grad()` or a torch
optimizer's `zero_grad()` that left every gradient None, registers none. Until that backward every
rank reads the sum as it was (between the forward and the backward, or in a no_grad forward before
the optimizer step). A rank whose step ran no backward (an empty shard) zeroes at the sync
instead. A backward with no forward through the replica since the sync (`dp.module(x)`) that added
onto a carried slot cannot be told from the carried sum, and is refused at the sync on every rank
alike (gradients a torch optimizer's `zero_grad()` set to None land fresh, and are summed as ever).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from phalanx.data_parallel.buckets import Bucket
from phalanx.errors import UsageError


class CarriedSum:
    """Whether the buckets hold a synced sum that no zero_grad cleared, and the zeroing that keeps it once.
    `rank`: this rank; `carry`: False where nothing needs doing (one rank; unsharded with `average=True`);
    `scale`: what the kept range is multiplied by as it opens (k under `average=True`, else 1)."""

    def __init__(self, *, rank: int, carry: bool = True, scale: int = 1) -> None:
        self.rank, self._carry, self._scale = rank, carry, scale
        self.armed = False  # the buckets hold the last sync's sum, not zeroed since
        self._kept: list[tuple[int, int]] | None = None  # shard="optimizer": each bucket's range this rank keeps
        self._hooks: list = []

    def keep(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Under `shard="optimizer"`: each bucket's range [lo, hi) that this rank keeps (its own shard)."""
        self._kept = list(ranges)

    def synced(self) -> None:
        """After a sync: the buckets hold its sum until zero_grad."""
        self.armed = self._carry

    def cleared(self) -> None:
        """zero_grad: nothing carried."""
        self.armed = False
        self._remove()

    def before_forward(self, params: Sequence[nn.Parameter], open_: Callable[[], None]) -> None:
        """At the replica's forward: where a sum is carried and a backward may follow, hook every
        parameter so the first gradient to arrive calls `open_` first (rank 0 unsharded keeps all: none)."""
        if not self.armed or self._hooks or not torch.is_grad_enabled():
            return
        if (self.rank == 0 and self._kept is None) or all(param.grad is None for param in params):
            self.armed = False  # nothing held (a torch optimizer's zero_grad()), or all of it kept here
            return
        self._hooks = [param.register_hook(lambda grad: self._open(open_)) for param in params if param.requires_grad]

    def _open(self, open_: Callable[[], None]) -> None:
        if self.armed:
            self.armed = False
            open_()
        self._remove()

    def zero(self, buckets: Sequence[Bucket]) -> None:
        """This rank's share of the carried sum: rank 0 all of it (no zeroing), others none; sharded,
        its own range of each bucket (times `scale`)."""
        with torch.no_grad():
            for index, bucket in enumerate(buckets):
                if self._kept is None:
                    if self.rank != 0:
                        bucket.buffer.zero_()
                    continue
                lo, hi = self._kept[index]
                bucket.buffer[:lo].zero_()
                bucket.buffer[hi:].zero_()
                if self._scale != 1:  # average=True: the division after the sum leaves g_old whole
                    bucket.buffer[lo:hi].mul_(self._scale)

    def before_sum(self, *, landed: bool, added: bool, open_: Callable[[], None]) -> None:
        """At the sync, before the buckets go out: still armed means no backward reached a hook here. None
        `landed` (this rank ran no backward): zero what this rank does not keep. Each landed fresh (a torch
        optimizer's zero_grad() had set it to None), none `added` onto its slot: nothing carried into them."""
        self._remove()
        if not self.armed:
            return
        self.armed = False
        if not landed:
            open_()
        elif added:
            raise UsageError("gradients carried from the last step (no zero_grad since its sync) met a backward "
                             "with no forward through the replica (dp.module(x)?): call the replica, dp(x), or "
                             "zero_grad before each step's backward")

    def _remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
