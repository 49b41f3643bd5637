"""A sharded replica's state as ranges of the flat order: what a rank saves, and how any k reads it.

A rank's share (`rank_state`) is its ranges of the flat order (one per bucket it owns part of)
with, for each range, the parameters' values and every per-element optimizer state (Adam's
`exp_avg`, SGD's `momentum_buffer`, ...: tensors shaped like the parameter), plus per-parameter
scalars (Adam's `step`) and the optimizer's param groups by parameter *name*. Ranges of one flat
order, which depends neither on k nor on the bucket cap, are what lets a checkpoint written at
k devices be read at any other k, sharded or not:

- a `Reader` answers `read(key, start, stop)` for any flat range, `scalars(name)` and
  `element_keys(name)`: `RangesReader` over k ranks' shares, `WholeReader` over a whole model's
  state dict and a plain torch optimizer's state dict (a `shard="none"` checkpoint);
- `load_shard` puts what a reader holds into a sharded replica (each rank reads its own ranges,
  then stages 1 and 2 all-gather), and `whole_state` turns a reader into a whole model's state
  dict and a plain optimizer's state dict (for `shard="none"`, one device, or model.pt).

Per-element state is told from scalars by shape: in a share, a tensor with the piece's one
dimension and length is per element; in a whole optimizer's state, a key whose tensors have
their parameter's shape on every parameter that holds it. A 0-d parameter's moments are 0-d as
its `step` is, so its shape alone cannot tell them apart: the key decides (`step`, the one
counter torch's own load_state_dict tells by name, is a scalar wherever no larger parameter
says otherwise); anything else (a 0-d `step`, a number) belongs to the parameter.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
from torch import nn

from phalanx.data_parallel.sharding.flat_layout import intersect, laid_out_like, memory_order_of
from phalanx.data_parallel.sharding.optim import SHARE_KEY

PARAMETERS = "parameters"  # the key of the parameters' own values among the state keys


class Reader(Protocol):
    groups: list[dict]  # each param group's hyperparameters, and "names": its parameters' names

    def read(self, key: str, start: int, stop: int) -> torch.Tensor: ...
    def scalars(self, name: str) -> dict[str, Any]: ...
    def element_keys(self, name: str) -> list[str]: ...


def _per_element(value: Any, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == numel


def rank_state(dp, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's share of a sharded replica `dp` and its `dp.optimizer(...)`, as saved."""
    sharding = dp.sharding
    record = sharding.optimizers[optimizer]
    ranges, tensors = [], {PARAMETERS: []}
    spans = {}  # bucket index -> (flat start, position in ranges)
    for index, start, stop in sharding.params.owned_flat():
        spans[index] = (start, len(ranges))
        ranges.append((start, stop))
        tensors[PARAMETERS].append(sharding.params.shard[index].detach().clone())
    scalars, element_keys = {}, {}
    for piece, owned in record.pieces:
        state = optimizer.state.get(piece, {})
        name = owned.slot.name
        scalars[name] = {k: v for k, v in state.items() if not _per_element(v, piece.numel())}
        element_keys[name] = sorted(k for k, v in state.items() if _per_element(v, piece.numel()))
        first, position = spans[owned.slot.bucket]
        at = owned.slot.offset + owned.start - first
        for key in element_keys[name]:
            per_range = tensors.setdefault(key, [None] * len(ranges))
            if per_range[position] is None:
                per_range[position] = torch.zeros(ranges[position][1] - ranges[position][0], dtype=state[key].dtype)
            per_range[position][at:at + piece.numel()] = state[key].detach().cpu()
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "names": names}
              for group, names in zip(optimizer.param_groups, record.group_names)]
    return {"ranges": ranges, "tensors": tensors, "scalars": scalars, "element_keys": element_keys, "groups": groups}


class RangesReader:
    """A `Reader` over ranks' shares (`rank_state`'s, each given lazily by `load(i)`)."""

    def __init__(self, shares_ranges: list[list[tuple[int, int]]], load: Callable[[int], dict], groups: list[dict]) -> None:
        self._ranges, self._load, self.groups = shares_ranges, load, groups
        self._loaded: dict[int, dict] = {}

    def _share(self, index: int) -> dict:
        if index not in self._loaded:
            self._loaded[index] = self._load(index)
        return self._loaded[index]

    def read(self, key: str, start: int, stop: int) -> torch.Tensor:
        pieces = []
        for index, ranges in enumerate(self._ranges):
            for position, (lo, hi) in enumerate(ranges):
                a, b = intersect((start, stop), (lo, hi))
                if b > a:
                    tensor = self._share(index)["tensors"][key][position]
                    pieces.append((a, tensor[a - lo:b - lo]))
        pieces.sort(key=lambda item: item[0])
        found = torch.cat([t for _, t in pieces]) if pieces else torch.empty(0)
        if found.numel() != stop - start:
            raise ValueError(f"the checkpoint's shards hold {found.numel()} of the {stop - start} elements "
                             f"[{start}, {stop}) of {key}")
        return found

    def _first_with(self, name: str, what: str):
        for index in range(len(self._ranges)):
            share = self._share(index)
            if name in share[what]:
                return share[what][name]
        return {} if what == "scalars" else []

    def scalars(self, name: str) -> dict[str, Any]:
        return self._first_with(name, "scalars")

    def element_keys(self, name: str) -> list[str]:
        return self._first_with(name, "element_keys")


class WholeReader:
    """A `Reader` over a whole model's state dict and a plain optimizer's state dict whose
    parameter indices follow `names` (the order the optimizer was given the parameters in);
    `slots` is the flat layout (FlatLayout.slots) to read ranges through."""

    def __init__(self, model_state: dict, optimizer_state: dict, *, names: list[str | None], slots) -> None:
        self._model, self._slots = model_state, list(slots)
        self._state = {names[int(i)]: s for i, s in optimizer_state.get("state", {}).items()}
        for name, entry in self._state.items():  # a state read as another parameter's would not fit it
            for key, value in entry.items():
                whole = model_state.get(name)
                if isinstance(value, torch.Tensor) and value.dim() >= 1 and whole is not None \
                        and value.shape != whole.shape:
                    raise ValueError(f"its {key!r} of {name} has shape {tuple(value.shape)}, the parameter "
                                     f"{tuple(whole.shape)}: build the optimizer's param groups as the saving run did")
        self._element_keys = _element_keys(self._state, model_state)
        trained = {slot.name for slot in self._slots}  # a frozen parameter has no slot, as in a sharded group
        self.groups = [{**{k: v for k, v in g.items() if k != "params"},
                        "names": [names[int(i)] for i in g["params"] if names[int(i)] in trained]}
                       for g in optimizer_state.get("param_groups", [])]

    def read(self, key: str, start: int, stop: int) -> torch.Tensor:
        parts = []
        for slot in self._slots:
            a, b = intersect((start, stop), (slot.offset, slot.stop))
            if b > a:
                whole = self._model[slot.name] if key == PARAMETERS else self._state[slot.name][key]
                parts.append(memory_order_of(whole, slot, device=torch.device("cpu"))[a - slot.offset:b - slot.offset])
        return torch.cat(parts) if parts else torch.empty(0)

    def scalars(self, name: str) -> dict[str, Any]:
        state = self._state.get(name, {})
        return {k: v for k, v in state.items() if k not in self._element_keys}

    def element_keys(self, name: str) -> list[str]:
        return sorted(k for k in self._state.get(name, {}) if k in self._element_keys)


def _element_keys(state: dict[str, dict], model_state: dict) -> set[str]:
    """The keys of a whole optimizer's `state` (by parameter name) that hold a tensor shaped like
    its parameter on every parameter that holds them. Where only 0-d parameters hold a key, its
    shape says nothing (a 0-d `exp_avg` and a 0-d `step` alike): `step` is then a scalar."""
    fits: dict[str, bool] = {}
    decided_by_shape: set[str] = set()  # keys some parameter of at least one dimension holds
    for name, entry in state.items():
        whole = model_state.get(name)
        for key, value in entry.items():
            fits[key] = fits.get(key, True) and isinstance(value, torch.Tensor) and whole is not None \
                and value.shape == whole.shape
            if whole is not None and whole.dim() >= 1:
                decided_by_shape.add(key)
    return {key for key, fit in fits.items() if fit and (key in decided_by_shape or key != "step")}


def load_shard(dp, optimizer: torch.optim.Optimizer, reader: Reader) -> None:
    """Put `reader`'s state into the sharded replica `dp` and its `dp.optimizer(...)`: each rank
    reads its own ranges; stages 1 and 2 then all-gather so every replica is whole again."""
    sharding = dp.sharding
    sharding.params.check_outside_whole("phalanx.resume(...)", "resume before the block")
    for index, start, stop in sharding.params.owned_flat():
        with torch.no_grad():
            sharding.params.shard[index].copy_(reader.read(PARAMETERS, start, stop))
    sharding.gather_after_step()
    record = sharding.optimizers[optimizer]
    state, index_of = {}, {}
    for index, (piece, owned) in enumerate(record.pieces):
        index_of[id(piece)] = index
        first = owned.slot.offset
        entry = dict(reader.scalars(owned.slot.name))
        for key in reader.element_keys(owned.slot.name):
            entry[key] = reader.read(key, first + owned.start, first + owned.stop)
        if entry:
            state[index] = entry
    _check_group_count(reader.groups, len(record.group_names))
    saved_groups = {tuple(g["names"]): g for g in reader.groups}
    groups = []
    for group, names in zip(optimizer.param_groups, record.group_names):
        saved = saved_groups.get(tuple(names), {})
        if reader.groups and not saved:  # its lr and the rest would be the constructor's, silently
            raise ValueError(f"no saved param group holds exactly {_shown(names)}: build the optimizer's param "
                             "groups as the saving run did")
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       **{k: v for k, v in saved.items() if k != "names"},
                       "params": [index_of[id(p)] for p in group["params"]]})
    optimizer.load_state_dict({"state": state, "param_groups": groups, SHARE_KEY: record.share})


def whole_state(reader: Reader, *, slots, names: list[str],
                group_names: list[list[str]] | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """A whole model's parameters (by name) and a plain torch optimizer's state dict over the
    parameters in the order `names` gives, from any reader; `slots`: the flat layout.
    `group_names`: the loading optimizer's groups by parameter name, frozen ones included (a
    saved group names only what a slot holds), each given the saved group of its other names;
    `names` is then theirs, group after group, as torch numbers them."""
    params, state = {}, {}
    for slot in slots:
        params[slot.name] = laid_out_like(reader.read(PARAMETERS, slot.offset, slot.stop), slot.shape, slot.stride)
    by_slot = {slot.name: slot for slot in slots}
    for index, name in enumerate(names):
        slot = by_slot.get(name)
        if slot is None:
            continue
        entry = dict(reader.scalars(name))
        for key in reader.element_keys(name):
            entry[key] = laid_out_like(reader.read(key, slot.offset, slot.stop), slot.shape, slot.stride)
        if entry:
            state[index] = entry
    position = {name: index for index, name in enumerate(names)}
    if group_names is None:
        groups = [{**{k: v for k, v in g.items() if k != "names"}, "params": [position[n] for n in g["names"]]}
                  for g in reader.groups]
        return params, {"state": state, "param_groups": groups}
    _check_group_count(reader.groups, len(group_names))
    saved_groups = {tuple(g["names"]): g for g in reader.groups}
    groups, first = [], 0
    for group in group_names:
        trained = tuple(name for name in group if name in by_slot)
        if trained not in saved_groups:
            raise ValueError(f"no saved param group holds exactly {_shown(list(trained))}: build the optimizer's "
                             "param groups as the saving run did")
        groups.append({**{k: v for k, v in saved_groups[trained].items() if k != "names"},
                       "params": list(range(first, first + len(group)))})
        first += len(group)
    return params, {"state": state, "param_groups": groups}


def _check_group_count(saved: list[dict], loading: int) -> None:
    """Each loading group takes the saved group of its names, so a saved group no loading group
    takes (one the saving run added with add_param_group) would be dropped silently, its
    parameters' state lost; torch's own load refuses a different count too."""
    if saved and len(saved) != loading:
        raise ValueError(f"the checkpoint's optimizer has {len(saved)} param groups, this one {loading}")


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")


def trainable_names(module: nn.Module) -> list[str]:
    """The names of `module`'s parameters in the order `module.parameters()` gives them."""
    return [name for name, _ in module.named_parameters()]
