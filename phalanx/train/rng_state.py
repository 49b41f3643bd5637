"""A process's random number generators as checkpoint data: torch's (CPU and GPU), numpy's and Python's.

A resumed run continues bit for bit only if every rank's generators continue where they were
(dropout masks, augmentation, a user's own sampling), so a checkpoint keeps each rank's state.
numpy's and Python's are turned into tensors, ints and lists: what a weights-only load accepts.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"key": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                       "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
             "python": _to_lists(random.getstate())}
    # A GPU rank draws its dropout masks and randn on the device's own generator, not the CPU's:
    # without it a resumed GPU run draws other masks than the uninterrupted one. Only where CUDA
    # is already in use (asking otherwise would start it); the current device is the rank's own,
    # which runtime/world.py sets.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _to_lists(value):
    return [_to_lists(v) for v in value] if isinstance(value, (tuple, list)) else value


def _to_tuples(value):
    return tuple(_to_tuples(v) for v in value) if isinstance(value, list) else value


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    random.setstate(_to_tuples(state["python"]))
    if state.get("cuda") is not None and torch.cuda.is_available():  # absent: saved on a CPU, or before 2026-12-03
        torch.cuda.set_rng_state(state["cuda"])
