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
"""

from __future__ import annotations

import functools
import weakref

from torch.amp.grad_scaler import GradScaler

from phalanx.errors import UsageError

UNSCALE_BEFORE_SYNC = ("scaler.unscale_(optimizer) (or scaler.step, which calls it) before dp.finish_gradient_sync(): "
                       "it would unscale each rank's own unsummed gradients (racing the exchange where buckets went "
                       "out beside backward), and a rank whose own share overflowed would skip the step while the "
                       "others apply the summed inf; call dp.finish_gradient_sync() right after "
                       "scaler.scale(loss).backward(), then unscale_, clip and step")

_GUARDS: "weakref.WeakSet" = weakref.WeakSet()  # every live replica's UnsyncedGradientGuard
_WRAPPED: list = []  # torch's own unscale_, once wrapped


class UnscaleBeforeSync(UsageError, RuntimeError):
    """A GradScaler unscaled a replica's gradients before their sum."""


def watch(guard) -> None:
    """Have `guard` (an UnsyncedGradientGuard: `pending`, `steps_module(optimizer)`) consulted by
    every GradScaler.unscale_ while it lives; the first call wraps the method."""
    _GUARDS.add(guard)
    if not _WRAPPED:
        original = GradScaler.unscale_
        _WRAPPED.append(original)

        @functools.wraps(original)
        def unscale_(self, optimizer) -> None:
            if self.is_enabled() and any(guard.pending and guard.steps_module(optimizer) for guard in list(_GUARDS)):
                raise UnscaleBeforeSync(UNSCALE_BEFORE_SYNC)
            return original(self, optimizer)

        GradScaler.unscale_ = unscale_
