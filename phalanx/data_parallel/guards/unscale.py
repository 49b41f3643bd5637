"""A GradScaler's `unscale_` before `finish_gradient_sync()`, refused on every rank in one line.

The float16 recipe (`scaler.scale(loss).backward()`, `scaler.unscale_(optimizer)`, clip,
`scaler.step(optimizer)`) meets phalanx's one wait point between backward and the step. Unscaling
before the sync goes wrong two ways: where buckets went out beside backward (overlap), the
unscale writes into gradients the exchange is reading and writing, and the sum is garbage
(measured: 2 CPU workers ended 50x the parameters' size away from one device, float64, no error);
without overlap the sum is right, but each rank looked for inf/NaN in its own share only, so on an
overflow a rank whose share overflowed skips the step while the others apply the summed inf, and
the replicas part. DDP never meets this (its backward returns the sum). usage.py's check of the
buckets' version counters, which refuses a clip before the sync, cannot see it: torch's
`_amp_foreach_non_finite_check_and_unscale_` writes the gradients without moving their counters.

So `GradScaler.unscale_` (also called by `scaler.step` when the script did not) is wrapped, once,
the first time a replica that exchanges is made: while a replica holds a synced backward's
gradients not yet summed and the optimizer steps its parameters, it raises naming the fix. Nothing
else changes: a scaler used with no replica, or after the sync, runs torch's own method as it was.

A sharded optimizer (`dp.optimizer` under `shard=`) steps pieces whose `.grad` its step pre-hook
attaches, after a set_to_none `optimizer.zero_grad()` let go of them: unscale_ came before that
hook, found no gradient, and torch's step failed with a bare "No inf checks were recorded for this
optimizer". And each piece is this rank's range of the sum, so torch's check saw inf/NaN in that
range alone (after `dp.zero_grad()`, which keeps them): a rank whose range overflowed skipped the
step and halved its scale while the others stepped and waited in the all-gather after it. Its
unscale_ now attaches the pieces' gradients first and sums the ranks' found-inf flags after
(`agree_on_overflow`), so every rank skips alike.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch.amp.grad_scaler import GradScaler

from phalanx.comm import Tag
from phalanx.errors import UsageError

UNSCALE_BEFORE_SYNC = ("scaler.unscale_(optimizer) (or scaler.step, which calls it) before dp.finish_gradient_sync(): "
                       "it would unscale each rank's own unsummed gradients (racing the exchange where buckets went "
                       "out beside backward), and a rank whose own share overflowed would skip the step while the "
                       "others apply the summed inf; call dp.finish_gradient_sync() right after "
                       "scaler.scale(loss).backward(), then unscale_, clip and step")

_GUARDS: "weakref.WeakSet" = weakref.WeakSet()  # every live replica's UnsyncedGradientGuard
_WRAPPED: list = []  # torch's own unscale_, once wrapped
_SHARDED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # a sharded optimizer -> its replica, weakly


class UnscaleBeforeSync(UsageError, RuntimeError):
    """A GradScaler unscaled a replica's gradients before their sum."""


def watch(guard) -> None:
    """Have `guard` (an UnsyncedGradientGuard: `pending`, `steps_module(optimizer)`) consulted by
    every GradScaler.unscale_ while it lives; the first call wraps the method."""
    _GUARDS.add(guard)
    _wrap()


def agree_on_overflow(optimizer, dp, attach) -> None:
    """Have every GradScaler.unscale_ of `optimizer`, a sharded optimizer of replica `dp` whose
    pieces are this rank's range of the sum, first `attach()` the pieces' gradients (a set_to_none
    `zero_grad` let go of them), then find inf/NaN where any rank found it: each rank checks its own
    range, so without the sum a rank whose range overflowed would skip the step (and halve its
    scale) while the others step."""
    _SHARDED[optimizer] = (weakref.ref(dp), attach)
    _wrap()


def _agree(scaler: GradScaler, optimizer, dp) -> None:
    """This rank's found-inf flags for `optimizer` made the ranks' together (a one-number sum)."""
    found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    total = torch.zeros(1, dtype=torch.float32, device=dp.world.device)
    for value in found.values():
        total += value.to(total.device)
    dp.allreduce_now(total, tag=Tag("GradScaler inf check"))
    anywhere = (total[0] > 0).float()
    for value in found.values():
        value.copy_(anywhere)
    if not found:  # no piece here (a rank with an empty range): torch's step needs one flag
        found[dp.world.device] = anywhere


def _wrap() -> None:
    if _WRAPPED:
        return
    original = GradScaler.unscale_
    _WRAPPED.append(original)

    @functools.wraps(original)
    def unscale_(self, optimizer) -> None:
        if self.is_enabled() and any(guard.pending and guard.steps_module(optimizer) for guard in list(_GUARDS)):
            raise UnscaleBeforeSync(UNSCALE_BEFORE_SYNC)
        ref, attach = _SHARDED.get(optimizer, (None, None))
        dp = ref() if ref is not None else None
        if dp is not None and self.is_enabled():  # its pieces are no module parameters: asked of the replica
            unsynced = getattr(dp, "_unsynced", None)
            if dp.exchange_in_flight or (unsynced is not None and unsynced.pending):
                raise UnscaleBeforeSync(UNSCALE_BEFORE_SYNC)
            attach()
        result = original(self, optimizer)
        if dp is not None and self.is_enabled() and dp.world.distributed:
            _agree(self, optimizer, dp)
        return result

    GradScaler.unscale_ = unscale_
