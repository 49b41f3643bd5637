"""torch's own gradient clipping over a sharded replica's parameters, refused in one line.

After `finish_gradient_sync()` a sharded replica holds the summed gradient only over this rank's
range: stage 1 keeps whole `.grad` views whose other ranges are this rank's unsummed share, and
stages 2 and 3 keep no `.grad` at all. `torch.nn.utils.clip_grad_norm_(dp.parameters(), max)`
then computes this rank's own norm (stage 1: each rank another one, the replicas part) or 0
(stages 2 and 3: nothing is clipped), silently; `clip_grad_value_` clamps unsummed values, or
fails inside torch on an empty list. Making torch's function exact would need a collective inside
it (FSDP2 gets one from DTensor's norm); FSDP1 and DeepSpeed instead clip through their own entry
points (`model.clip_grad_norm_`, the `gradient_clipping` setting), as phalanx does:
`phalanx.clip_grad_norm_(dp, max_norm)` and `phalanx.clip_grad_value_(dp, clip_value)`.

So torch's two functions are wrapped, once, the first time a sharded replica is made (as
guards/unscale.py wraps GradScaler.unscale_): a call given any parameter of a live sharded
replica raises naming phalanx's function; every other call runs torch's own. The wrapper is
what `torch.nn.utils.clip_grad_norm_` names from then on; a script that bound the function
itself before (`from torch.nn.utils import clip_grad_norm_` ahead of the first `prepare`) keeps
torch's.
"""

from __future__ import annotations

import functools
import weakref
from typing import Callable

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

from phalanx.errors import UsageError

_WAYS = {"clip_grad_norm_": "phalanx.clip_grad_norm_(dp, max_norm)",
         "clip_grad_value_": "phalanx.clip_grad_value_(dp, clip_value)"}
_GUARDS: "weakref.WeakSet" = weakref.WeakSet()  # every live sharded replica's TorchClipGuard
_WRAPPED: dict[str, Callable] = {}  # torch's own functions, once wrapped


class TorchClipOnShards(UsageError, RuntimeError):
    """torch's clip_grad_norm_ / clip_grad_value_ was given a sharded replica's parameters."""


class TorchClipGuard:
    """Makes torch's clipping refuse the parameters `ids` (id of each) of a replica sharded at
    `stage`, while this guard lives and is not closed."""

    def __init__(self, ids: set[int], stage: str) -> None:
        self.ids, self.stage = ids, stage
        _GUARDS.add(self)
        for name in _WAYS:
            if name not in _WRAPPED:
                _wrap(name)

    def close(self) -> None:
        _GUARDS.discard(self)


def _wrap(name: str) -> None:
    original = getattr(torch.nn.utils.clip_grad, name)
    _WRAPPED[name] = original

    @functools.wraps(original)
    def refusing(parameters, *args, **kwargs):
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)  # a generator once
        for guard in list(_GUARDS):
            if any(id(param) in guard.ids for param in parameters):
                held = "only its own range of .grad is summed" if guard.stage == "optimizer" else \
                    "its .grad is None, the sum kept in its own range"
                raise TorchClipOnShards(
                    f"torch.nn.utils.{name} over a replica with shard={guard.stage!r}, where on each rank {held}: "
                    f"torch's would clip by this rank's values alone; use {_WAYS[name]} after "
                    "dp.finish_gradient_sync()")
        return original(parameters, *args, **kwargs)

    setattr(torch.nn.utils.clip_grad, name, refusing)
    setattr(torch.nn.utils, name, refusing)
