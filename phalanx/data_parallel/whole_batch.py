"""A forward handed a loader's whole batch where one tensor belongs, named in one line.

`ShardedLoader.epoch(e)` yields `(batch, global_size)`. A loop moved over from DDP's `for x, y
in loader:` by swapping in `loader.epoch(e)` unpacks that pair: `x` is the whole batch (a list
of the inputs and the labels) and `y` the global size, and the model's first layer fails with
torch's "linear(): argument 'input' (position 1) must be Tensor, not list" (or conv2d's "invalid
combination of arguments - got (list, ...)", or a forward's own "'list' object has no attribute
'view'"), which names neither the loop nor the fix. `WholeBatchPassed` is raised from that error
only where it is a list's or tuple's, and a positional input is a list or tuple of 2 or more
tensors with the same number of rows: what a collated batch looks like.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from phalanx.errors import UsageError


class WholeBatchPassed(UsageError, TypeError):
    """A collated batch (inputs and labels together) handed to a forward that takes a tensor."""


def whole_batch_passed(exc: Exception, args: Sequence[Any]) -> WholeBatchPassed | None:
    """The one-line error for `exc`, raised by a forward on positional `args`, where one of them is
    a collated batch and `exc` is about a list or tuple (module docstring); else None."""
    if not isinstance(exc, (TypeError, AttributeError)):
        return None
    said = str(exc)
    for position, arg in enumerate(args):
        kind = type(arg).__name__
        if not isinstance(arg, (list, tuple)) or kind not in said or len(arg) < 2:
            continue
        if all(isinstance(t, torch.Tensor) and t.ndim >= 1 for t in arg) and len({len(t) for t in arg}) == 1:
            return WholeBatchPassed(
                f"the model's forward got a {kind} of {len(arg)} tensors of {len(arg[0])} rows as its input {position}"
                f" (a collated batch: inputs and labels) where it takes a tensor; loader.epoch(e) yields (batch, "
                "global_size), so `for x, y in loader.epoch(e)` makes x the whole batch: write `for (x, y), "
                "global_size in loader.epoch(e)` (with micro_batches=: `for pieces, global_size in ...`)")
    return None
