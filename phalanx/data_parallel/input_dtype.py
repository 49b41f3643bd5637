"""A forward that fails because the input's dtype is not the model's, named in one line.

`prepare(model, dtype="float64")` casts the model, not the data: a float32 batch (any dataset
read through `ToTensor`, most of numpy's conversions aside) then meets torch's own message, "mat1
and mat2 must have the same dtype, but got Float and Double", or a conv's "Input type (float) and
bias type (double) should be the same", which name neither the cast nor where it came from. So
does a float64 batch under `precision="bf16-mixed"`: `torch.autocast` casts float32 inputs only.
Lightning Fabric's precision plugins ("64-true", "bf16-mixed") convert a module's floating inputs
before its forward, so a script ported from Fabric by docs/accelerate-fabric.md's table meets this
at its first step. phalanx leaves the data as one device would (a conversion it made would hide a
float64 dataset fed to a float32 model, half the precision the author thinks they have), and names
the cast instead: `InputDtypeMismatch`, raised from torch's error, only where torch's error is a
dtype's and a floating input's dtype is one the forward cannot take.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from phalanx.errors import UsageError


class InputDtypeMismatch(UsageError, RuntimeError):
    """A floating input whose dtype the model's forward cannot take (a RuntimeError, as torch's was)."""


def input_dtype_mismatch(exc: Exception, inputs: Iterable[Any], module: nn.Module,
                         autocast: tuple[str, torch.dtype] | None) -> InputDtypeMismatch | None:
    """The one-line error for `exc`, raised by `module`'s forward on `inputs` (the positional and
    keyword arguments' values), where it is an input dtype's (see the module docstring); else None."""
    if not isinstance(exc, RuntimeError) or "type" not in str(exc).lower():
        return None
    weights = {p.dtype for p in module.parameters() if p.is_floating_point()}
    if len(weights) != 1:
        return None
    (weight,) = weights
    taken = {weight, torch.float32, autocast[1]} if autocast is not None else {weight}
    given = next((t.dtype for t in _tensors(inputs) if t.is_floating_point() and t.dtype not in taken), None)
    if given is None:
        return None
    want = weight if autocast is None else torch.float32
    how = (f"the model is {_name(weight)} (prepare's dtype= casts the model, not the data)" if autocast is None else
           f"torch.autocast ({_name(autocast[1])}, prepare's precision=) casts float32 inputs only")
    return InputDtypeMismatch(f"the model's forward took a {_name(given)} input and {how}: pass x.to({want}) "
                              f"(Fabric's precision converted inputs itself; phalanx leaves the data as one device "
                              f"would)")


def _tensors(inputs: Iterable[Any]) -> Iterable[torch.Tensor]:
    """The tensors among `inputs`, and one level into a tuple, list or dict of them (a batch)."""
    for item in inputs:
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, (tuple, list)):
            yield from (t for t in item if isinstance(t, torch.Tensor))
        elif isinstance(item, dict):
            yield from (t for t in item.values() if isinstance(t, torch.Tensor))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
