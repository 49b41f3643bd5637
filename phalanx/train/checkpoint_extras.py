"""The rest of a script's training state in its checkpoint: a learning-rate scheduler, a
GradScaler, an EMA.

`phalanx.checkpoint(..., extras={"scheduler": scheduler, "scaler": scaler})` saves each object's
`state_dict()` beside the weights and the optimizer; `phalanx.resume(..., extras=...)` hands each
saved state to the same name's `load_state_dict()`. Without it a resumed run restarts its
learning-rate schedule (and a GradScaler its scale) from the beginning while its weights go on:
not the uninterrupted run. These objects are replicated like the model (every rank steps the
same scheduler, and a GradScaler that unscales after the sync sees the same summed gradient on
every rank), so rank 0's states are saved and every rank loads them.

Every rank checks its extras before any collective, so a wrong one is the same one-line error on
every rank, not a hang: each value needs `state_dict()` and `load_state_dict()`, and its state
must be what a weights-only load reads back (tensors, numbers, strings, and lists, tuples and
dicts of them); anything else would make the written checkpoint look damaged when it is read.
A resume whose names differ from the checkpoint's is refused, naming them: a name saved but not
given, or given but not saved, would resume part of the state from the beginning.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from pathlib import Path
from typing import Any, Mapping

import torch

from phalanx.errors import UsageError

# What torch.load(weights_only=True) surely reads back besides tensors and containers of them, by
# exact type (numpy.float64 is a float, and refused there). Any other value is asked of torch
# itself, by a round trip of that value alone (a MultiStepLR's Counter of milestones loads).
_PLAIN = frozenset({str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device, torch.Size})


def extra_states(extras: Mapping[str, Any] | None) -> dict[str, Any]:
    """Each extra's `state_dict()`, checked to load back weights-only ({} for none)."""
    states = {}
    for name, obj in checked_extras(extras).items():
        state = obj.state_dict()
        where = _unloadable(state, f"extras[{name!r}].state_dict()")
        if where is not None:
            raise TypeError(f"{where}; a checkpoint holds only what torch.load(weights_only=True) reads back "
                            "(tensors, numbers, strings, and lists, tuples and dicts of them): give "
                            f"{type(obj).__name__} a state_dict() of those, or save it in a file of your own")
        states[name] = state
    return states


def check_extra_names(saved: Mapping[str, Any] | None, extras: Mapping[str, Any] | None, *, path: str | Path) -> None:
    """UsageError unless the checkpoint's extras (`saved`) and the resume's have the same names."""
    given, kept = set(checked_extras(extras)), set(saved or {})
    missing, unsaved = sorted(kept - given), sorted(given - kept)
    if missing:
        raise UsageError(f"checkpoint {path} holds the state of extras {_names(missing)}, which this resume was not "
                         f"given; pass phalanx.resume the extras phalanx.checkpoint was given "
                         f"(extras={{{', '.join(f'{n!r}: ...' for n in missing)}}}), or it would start them from "
                         "the beginning")
    if unsaved:
        raise UsageError(f"checkpoint {path} holds no state for extras {_names(unsaved)} (saved without them); "
                         "resume from a checkpoint saved with the same extras, or drop them from phalanx.resume "
                         "to start them from the beginning")


def load_extras(saved: Mapping[str, Any] | None, extras: Mapping[str, Any] | None, *, path: str | Path) -> None:
    """Hand each saved state to the same name's `load_state_dict()`; `check_extra_names` passed
    already (restore checks them before it applies anything)."""
    for name, state in (saved or {}).items():
        obj = extras[name]
        try:
            obj.load_state_dict(state)
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UsageError(f"checkpoint {path}: extras[{name!r}] ({type(obj).__name__}) does not take "
                             f"the saved state ({reason[:160]}); resume with the object that saved it") from None


def checked_extras(extras: Mapping[str, Any] | None) -> dict[str, Any]:
    """`extras` as a dict of named objects that save and load state; TypeError naming the first that does not."""
    if extras is None:
        return {}
    if not isinstance(extras, Mapping):
        raise TypeError(f"extras takes a dict of names to objects, got {type(extras).__name__}; e.g. "
                        "extras={'scheduler': scheduler, 'scaler': scaler}")
    for name, obj in extras.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"extras' names are the keys its states are saved under: non-empty strings, got {name!r}")
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"extras[{name!r}] is a {type(obj).__name__}, which has no state_dict() and "
                            "load_state_dict(); extras takes objects that save and load their state (a learning-rate "
                            "scheduler, a GradScaler, an EMA model); keep plain values in such an object or a file of "
                            "your own")
    return dict(extras)


def _unloadable(value: Any, where: str) -> str | None:
    """Where in `value` something sits that a weights-only load refuses (None: nothing)."""
    if isinstance(value, torch.Tensor) or type(value) in _PLAIN:
        return None
    if type(value) in (dict, OrderedDict):
        for key, item in value.items():
            found = _unloadable(key, f"{where} key") or _unloadable(item, f"{where}[{key!r}]")
            if found:
                return found
        return None
    if type(value) in (list, tuple):
        for i, item in enumerate(value):
            found = _unloadable(item, f"{where}[{i}]")
            if found:
                return found
        return None
    if _loads_weights_only(value):
        return None
    return f"{where} holds a {type(value).__module__}.{type(value).__qualname__}"


def _loads_weights_only(value: Any) -> bool:
    """Whether torch.load(weights_only=True) reads `value` back."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception:  # noqa: BLE001 - pickling and weights-only refusals alike
        return False
    return True


def _names(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names)
