"""DDP's `module.` prefix in a state dict, read by a replica whose names carry none.

A checkpoint saved from torch DDP (`ddp.state_dict()`) names every key `module.<name>`; phalanx's
replica names them as the model does (replica.py), so `dp.load_state_dict` takes either.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Mapping

from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

DDP_PREFIX = "module."


def without_ddp_prefix(state_dict: Mapping[str, Any], module: nn.Module) -> Mapping[str, Any]:
    """`state_dict` with DDP's `module.` prefix removed when every key carries it and `module`'s
    own keys do not (a model with a child named `module` keeps its keys as they are)."""
    keys = list(state_dict.keys())
    if not keys or not all(k.startswith(DDP_PREFIX) for k in keys):
        return state_dict
    own = [name for name, _ in module.named_parameters()] + [name for name, _ in module.named_buffers()]
    if any(k.startswith(DDP_PREFIX) for k in own):
        return state_dict
    stripped = OrderedDict(state_dict)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:  # version info of the layers (BatchNorm's), keyed by module path
        stripped._metadata = copy.copy(metadata)
    consume_prefix_in_state_dict_if_present(stripped, DDP_PREFIX)
    return stripped


__all__ = ["DDP_PREFIX", "without_ddp_prefix"]
