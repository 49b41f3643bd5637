"""A bf16-mixed forward's outputs widened to float32, each inside its own container.

Under `prepare(..., precision="bf16-mixed")` the forward runs under `torch.autocast`; the loss a script
computes from its outputs should be float32, as Fabric and Accelerate return them. The containers stay what
the model returned, so a Hugging Face `ModelOutput` is still read as `out.logits`.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch


def widened(out: Any) -> Any:
    """Floating tensors narrower than float32 in `out` (tensor, tuple, list, dict, dataclass), as
    float32, in containers of the same type: a dict subclass (Hugging Face's `ModelOutput`, read as
    `out.logits`) is a shallow copy with its items replaced, a dataclass a `dataclasses.replace`."""
    if isinstance(out, torch.Tensor):
        return out.float() if out.is_floating_point() and out.element_size() < 4 else out
    if isinstance(out, dict):
        copied = copy.copy(out)
        for key, value in out.items():
            copied[key] = widened(value)
        return copied
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        fields = [field.name for field in dataclasses.fields(out) if field.init]
        return dataclasses.replace(out, **{name: widened(getattr(out, name)) for name in fields})
    if isinstance(out, tuple) and hasattr(out, "_fields"):  # a namedtuple takes its fields positionally
        return type(out)(*(widened(value) for value in out))
    if isinstance(out, (tuple, list)):
        return type(out)(widened(value) for value in out)
    return out
