"""Replicas compared: whether every rank still holds the same parameters and optimizer.

Data parallelism is "k devices = 1 device" only while every replica applies the same update to
the same weights. A change made on some ranks only breaks it without a sound: a checkpoint
loaded on rank 0 after `prepare` (Horovod's habit, where `broadcast_parameters` followed), an lr
scheduler stepped under `if world.is_main:`, ReduceLROnPlateau stepped on each rank's own
validation loss. From then on the ranks train apart; an evaluation mixes their models into one
number and a checkpoint keeps rank 0's.

`check_replicas_agree` compares, in one small collective, each rank's `fingerprint`: the
parameters, every optimizer's settings per param group (lr, momentum, betas, ...) and a whole
optimizer's state. Bits, not values: each tensor's bit pattern is summed as integers, wrapping,
which is exact and the same in any order (a float sum depends on how many threads reduced it),
and the tensors' sums are weighted by position (two swapped tensors differ). Replicas in
lockstep hold identical bytes, so any difference is a divergence, and an error: what follows is
not data parallelism any more. Summing is one vectorised pass, 1.3 ms for the mlp's 5.8 M
parameters on one core (a float64 sum of them: 21 ms). Only where rows differ - every rank sees
the same rows, so every rank takes this path - a second exchange measures the difference (each
parameter against the reference rank's, broadcast one tensor at a time; each rank's settings),
so the one line names the ranks, how far apart, and the fix.

The buffers are compared after them, by the evaluation's comparison (checks.py's `check_replicas`):
a buffer the forward updates from each rank's own data (an EMA codebook) drifts apart silently,
and a checkpoint would keep rank 0's. Left out: the norm layers' running statistics, which
running_stats.py averages after the step this check runs in, or which follow each rank's data
under `average_running_stats=False` until the script averages them. Not compared: a sharded optimizer's state (each rank holds its share), the
local optimizer inside torch's `ZeroRedundancyOptimizer` (each rank's own partition; the wrapper's
settings are compared, and its broadcast keeps the parameters alike), and the
parameters of a replica sharded to `shard="parameters"` (each rank holds its own range, and
every forward gathers one whole). A replica's optimizers are those it saw step it (`ReplicaCheck`),
plus any a caller names. `evaluate_dataset(dp.module, ...)`, the form the README's script uses,
finds the replica by its module (`replica_of`) and compares as the replica would, optimizers too.
"""

from __future__ import annotations

import sys
import weakref
from typing import Callable, Iterable, Sequence

import torch

from phalanx.comm import Tag, broadcast_, gather_objects
from phalanx.data_parallel.guards.checks import ReplicaMismatch, check_replicas
from phalanx.data_parallel.guards.running_stats import drifting_norm_layers
from phalanx.data_parallel.replica_hook import OptimizerVerdicts, on_every_optimizer_step, steps_replica
from phalanx.runtime.world import World

ROW = 6  # per rank: parameters, optimizer settings, optimizer state, each 64 bits as two exact 32-bit halves
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_LOAD = ("a checkpoint loaded (or weights changed) on some ranks only after phalanx.prepare, as Horovod scripts load "
         "on rank 0 before broadcast_parameters: load on every rank, or before prepare, which broadcasts rank 0's "
         "state")
_SETTING = ("an lr scheduler stepped (or an optimizer setting changed) on some ranks only, under `if world.is_main:` or "
            "on each rank's own metric (ReduceLROnPlateau on a local validation loss): step it on every rank, on a "
            "metric averaged over the ranks (phalanx.reduce(value, world=world))")
# Each live replica whose check compares, by its module: evaluate_dataset(dp.module, ...) compares as it would.
_REPLICAS: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref] = weakref.WeakKeyDictionary()


def partitioned_inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """A `ZeroRedundancyOptimizer`'s local optimizer, which steps this rank's partition of the
    parameters (its state differs between ranks by design, then the wrapper broadcasts each
    partition); None for any other optimizer."""
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")  # not imported: none exists
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        return getattr(optimizer, "optim", None)
    return None


def replica_of(module: torch.nn.Module):
    """The open replica (a ReplicaModule) whose module is `module` and whose check compares, or None."""
    found = _REPLICAS.get(module)
    return found() if found is not None else None


def _as_ints(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s elements as integers of the same width: a float's bit pattern, a bool as a byte."""
    flat = tensor.detach()
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    return flat.view(_INTS[flat.element_size()]) if flat.is_floating_point() else flat


def bit_sum(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s bit pattern summed as integers, wrapping (an int64 scalar on its device): exact,
    and the same whatever order or thread count sums it."""
    ints = _as_ints(tensor)
    # int32 wraps in the vectorised sum; int64's accumulation is not vectorised (20 ms for the mlp).
    return ints.sum(dtype=torch.int64 if ints.element_size() == 8 else torch.int32).to(torch.int64)


def _folded(sums: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One int64 from many, each weighted by its position (wrapping), so a swap shows."""
    if not sums:
        return torch.zeros((), dtype=torch.int64, device=device)
    stacked = torch.stack([s.to(device) for s in sums])
    return (stacked * torch.arange(1, len(sums) + 1, dtype=torch.int64, device=device)).sum()


def settings(optimizers: Sequence[torch.optim.Optimizer]) -> list[tuple[int, int, str, float]]:
    """Every number in the optimizers' param groups but the parameters: (optimizer, group, key, value)."""
    found = []
    for o, optimizer in enumerate(optimizers):
        for g, group in enumerate(optimizer.param_groups):
            for key in sorted(k for k in group if k != "params"):
                values = group[key] if isinstance(group[key], (tuple, list)) else [group[key]]
                for i, value in enumerate(values):
                    if isinstance(value, torch.Tensor) and value.numel() == 1:
                        value = value.item()
                    if isinstance(value, (bool, int, float)):
                        found.append((o, g, key if len(values) == 1 else f"{key}[{i}]", float(value)))
    return found


def _state_sums(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    sums = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            for key, value in sorted(optimizer.state.get(param, {}).items()):
                if isinstance(value, torch.Tensor) and value.layout == torch.sparse_coo:  # SGD's sparse momentum
                    sums += [bit_sum(value._indices()), bit_sum(value._values())]
                elif isinstance(value, torch.Tensor):
                    sums.append(bit_sum(value))
                elif isinstance(value, (bool, int, float)):
                    sums.append(bit_sum(torch.tensor(float(value), dtype=torch.float64)))
    return sums


@torch.no_grad()
def fingerprint(parameters: Sequence[torch.Tensor], optimizers: Sequence[torch.optim.Optimizer], *,
                whole_state: bool, device: torch.device) -> torch.Tensor:
    """This rank's ROW float64 numbers: the parameters', the optimizers' settings' and (`whole_state`)
    their state's bit sums, each an int64 split into two exact 32-bit halves."""
    values = torch.tensor([v for *_, v in settings(optimizers)], dtype=torch.float64)
    parts = [_folded([bit_sum(p) for p in parameters], device),
             _folded([bit_sum(values)] if values.numel() else [], device),
             _folded([s for o in optimizers for s in _state_sums(o)] if whole_state else [], device)]
    halves = [piece for word in parts for piece in (word & 0xFFFFFFFF, (word >> 32) & 0xFFFFFFFF)]
    return torch.stack(halves).to(torch.float64)


class ReplicaCheck:
    """A replica's comparison with its peers: at its first synced step (a load made on one rank
    after prepare shows there, before anything trains on it), every `every` synced steps (the
    NaN/Inf check's interval; 0: never), and when asked (`check`). `sharding`: the replica's
    (None: unsharded); `allreduce(flat, tag)`: its exchange's small in-place sum; `owner`: the replica,
    found by its module while open (`replica_of`).

    The optimizers compared are those that stepped the replica's parameters (or, sharded, its
    shards: `dp.optimizer`'s) since the last check - or, where none did, those of the last check -
    noted by a process-wide step pre-hook (a dict look-up per `optimizer.step()`, 0.4 us) and held
    until a later check lets them go. Not the live ones by weak reference: an optimizer the
    script dropped is collected when the garbage collector gets to it, which differs between
    ranks, and one rank would compare an optimizer the other no longer has."""

    def __init__(self, *, every: int, world: World, module: torch.nn.Module, sharding,
                 allreduce: Callable[[torch.Tensor, Tag], object], owner) -> None:
        self.every, self.world, self._module, self._sharding, self._allreduce = every, world, module, sharding, allreduce
        self._stepped: dict[int, torch.optim.Optimizer] = {}  # since the last check
        self._compared: list[torch.optim.Optimizer] = []  # at the last check
        self._verdicts = OptimizerVerdicts()  # does it step this replica?
        self._partitioned: weakref.WeakSet = weakref.WeakSet()  # ZeroRedundancyOptimizer's inner ones: never
        self._hook = on_every_optimizer_step(self.noted) if every and world.distributed else None
        self._registered = weakref.ref(owner) if self._hook is not None else None
        if self._registered is not None:
            _REPLICAS[module] = self._registered
        layers = {id(m) for m in drifting_norm_layers(module)}
        self._local = {f"{path}.{name}".lstrip(".") for path, m in module.named_modules() if id(m) in layers
                       for name, _ in m.named_buffers(recurse=False)}  # their statistics, by name

    def noted(self, optimizer: torch.optim.Optimizer) -> None:
        """`optimizer` is about to step: note it if it steps this replica (again once a group is added)."""
        if self._verdicts.of(optimizer, self._steps_replica):
            self._stepped[id(optimizer)] = optimizer

    def _steps_replica(self, optimizer: torch.optim.Optimizer) -> bool:
        inner = partitioned_inner(optimizer)
        if inner is not None:  # its own partition on each rank: the wrapper's settings are compared instead
            self._partitioned.add(inner)
        if optimizer in self._partitioned:
            return False
        return steps_replica(optimizer, self._module, self._sharding)

    def after_step(self, step: int) -> None:
        """Synced step `step` is summed: compare at the first and at every `every`-th."""
        if self.every and (step % self.every == 0 or step == 1):
            self.check(step=step, found=f"found at step {step}'s check: the first step and every {self.every} steps")

    def check(self, *, step: int, found: str, optimizers: Iterable[torch.optim.Optimizer] = ()) -> None:
        """Compare now (a collective: every rank calls it), with `optimizers` besides those noted."""
        if not self.every or not self.world.distributed:
            return
        if self._stepped:
            self._compared, self._stepped = list(self._stepped.values()), {}
        sharding = self._sharding
        whole = sharding is None or sharding.keeps_parameters  # stage 3: each rank holds its own range
        check_replicas_agree(world=self.world, parameters=list(self._module.named_parameters()) if whole else [],
                             optimizers=[*self._compared, *optimizers], whole_state=sharding is None, found=found,
                             allreduce=lambda flat: self._allreduce(flat, Tag("replica check", step=step)))
        # The buffers, by the evaluation's comparison (checks.py), but the norm layers' statistics: running_stats.py
        # averages them after this check's step, or (average_running_stats=False) they are each rank's own.
        check_replicas(self.world, self._module, step=step, buffers_only=True, skip=self._local, found=found)

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            if _REPLICAS.get(self._module) is self._registered:
                del _REPLICAS[self._module]
        self._stepped, self._compared = {}, []


def check_replicas_agree(*, world: World, parameters: Sequence[tuple[str, torch.Tensor]],
                         optimizers: Iterable[torch.optim.Optimizer], whole_state: bool, found: str,
                         allreduce: Callable[[torch.Tensor], object]) -> None:
    """Raise ReplicaMismatch, on every rank alike, if any rank's `parameters` (by name) or
    `optimizers` differ from the others'; `found`: where, for the line ("found by close() after
    step 6"); `allreduce` sums a small float64 tensor in place on every rank (a collective: every
    rank calls this at the same point, with the same parameter names and shapes)."""
    k = world.world_size
    if k < 2:
        return
    optimizers = list(dict.fromkeys(optimizers))  # one of each, in order
    rows = torch.zeros(k, ROW, dtype=torch.float64, device=world.device)
    rows[world.rank] = fingerprint([p for _, p in parameters], optimizers, whole_state=whole_state,
                                   device=world.device)
    allreduce(rows.view(-1))  # every rank fills its own row: the sum gathers them, exactly (integers < 2**32)
    table = [tuple(row) for row in rows.tolist()]
    if len(set(table)) == 1:
        return
    # The reference: the largest group of ranks alike (ties: the one holding rank 0).
    reference = min(range(k), key=lambda r: (-table.count(table[r]), r))
    apart = [r for r in range(k) if table[r] != table[reference]]
    differs = [any(table[r][i:i + 2] != table[reference][i:i + 2] for r in apart) for i in (0, 2, 4)]
    details = _measure(world, parameters, optimizers, reference=reference, compare_parameters=differs[0])
    raise ReplicaMismatch(_message(details, apart=apart, reference=reference, differs=differs, found=found,
                                   count=len(parameters)))


def _measure(world: World, parameters: Sequence[tuple[str, torch.Tensor]], optimizers, *, reference: int,
             compare_parameters: bool) -> list[dict]:
    """Every rank's differences from `reference`'s, gathered: how far its parameters are (each
    broadcast from the reference, one tensor at a time), and its settings. Only where rows differ."""
    tag = Tag("replica check")
    farthest, first, count = 0.0, None, 0
    for name, param in parameters if compare_parameters else ():
        theirs = param.detach().clone()
        broadcast_(theirs, world=world, src=reference, tag=tag)
        own = param.detach()
        same = torch.equal(_as_ints(own), _as_ints(theirs))
        if not same:
            count, first = count + 1, first or name
            far = (own.double() - theirs.double()).abs().max().item() if own.numel() else 0.0
            farthest = far if far != far or far > farthest else farthest  # a NaN stays
    mine = {"far": farthest, "first": first, "count": count, "settings": settings(optimizers)}
    return gather_objects(world, mine, tag)


def _ranks(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks[:-1]) + f" and {ranks[-1]}"


def _message(details: list[dict], *, apart: list[int], reference: int, differs: list[bool], found: str,
             count: int) -> str:
    ref = f"rank {reference}'s"
    what = []
    if differs[0]:
        worst = max(apart, key=lambda r: (details[r]["far"] != details[r]["far"], details[r]["far"]))
        d = details[worst]
        what.append(f"parameters differ from {ref} by up to {d['far']:.3g} (in {d['count']} of {count} tensors, "
                    f"{d['first']} first)")
    if differs[1]:
        what.append(_setting_difference(details, apart=apart, reference=reference))
    if differs[2]:
        what.append(f"optimizer state differs from {ref}")
    # A setting apart explains parameters apart (the ranks stepped with different lrs): named first.
    causes = ([_SETTING] if differs[1] else []) + ([_LOAD] if differs[0] or differs[2] else [])
    its = ", and their " if len(apart) > 1 else ", and its "
    return f"replicas diverged ({found}): {_ranks(apart)}'s " + its.join(what) + "; " + "; or ".join(causes)


def _setting_difference(details: list[dict], *, apart: list[int], reference: int) -> str:
    """The first optimizer setting in which a rank of `apart` differs from `reference`, in words."""
    ours = {(o, g, key): value for o, g, key, value in details[reference]["settings"]}
    for rank in apart:
        theirs = {(o, g, key): value for o, g, key, value in details[rank]["settings"]}
        for where in list(theirs) + [w for w in ours if w not in theirs]:
            if theirs.get(where) != ours.get(where):
                o, g, key = where
                which = f"param group {g}" + (f" of optimizer {o}" if o else "")
                return (f"optimizer's {key} is {theirs.get(where, 'unset'):.6g} where rank {reference}'s is "
                        f"{ours.get(where, 'unset'):.6g} ({which})" if where in ours and where in theirs else
                        f"optimizer's {key} is set in one of them only ({which})")
    return f"optimizer settings differ from rank {reference}'s"
