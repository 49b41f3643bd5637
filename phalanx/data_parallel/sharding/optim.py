"""`dp.optimizer(torch.optim.AdamW, lr=...)`: any element-wise torch optimizer, over this rank's shard.

A replica built with `shard=` hands its optimizer not the model's parameters but this rank's
*pieces* of them (stages.py's `Sharding.piece`: 1-D views of the rank's range, each with the
matching range of the summed gradient as its `.grad`). The optimizer is the user's own class,
unchanged - a real `torch.optim.AdamW`, so learning-rate schedulers, `param_groups` and
`state_dict()` work as always - and keeps state only for those pieces: 1/k of it. Its step
updates the rank's range in place; a step post-hook all-gathers the ranges back into every
replica (stages 1 and 2; stage 3 gathers before each use instead).

Exact because the update is element-wise: SGD (momentum, weight decay, Nesterov), Adam, AdamW,
RMSprop, Adagrad, Adadelta, Adamax, NAdam, RAdam, ASGD and Rprop compute each element's update
from that element's gradient and state alone, so updating a range equals updating the whole
and taking the range. An optimizer that needs a whole tensor or a statistic over all of them -
LBFGS's line search, SparseAdam's sparse rows, Adafactor's row and column factors, LAMB's or
LARS's per-layer trust ratio - would compute something else on a piece, and is refused in one
line; a class of your own whose update is element-wise passes with `elementwise=True`.
Param groups work as in torch (`dp.optimizer(cls, [{"params": decay}, {"params": no_decay,
"weight_decay": 0}], lr=...)`): each group gets this rank's pieces of its parameters. Without
sharding `dp.optimizer` is simply `cls(params or the model's parameters, **defaults)`.

Its `state_dict()` is this rank's share, tagged with the share it is (`SHARE_KEY`: rank, world
size, stage, the pieces' ranges); `load_state_dict` refuses any other in one line. A script that
saves rank 0's `optimizer.state_dict()` and loads it on every rank (right for a whole optimizer)
would otherwise give rank 1 rank 0's moments, silently when the shares have the same shapes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from phalanx.data_parallel.guards.unscale import agree_on_overflow
from phalanx.data_parallel.replica_hook import OptimizerVerdicts, on_every_optimizer_step, steps_replica
from phalanx.data_parallel.sharding.torch_clip import TorchClipGuard
from phalanx.errors import Misuse

# Element-wise updates: exact on any range of the parameters.
ELEMENTWISE = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop")
# Updates that read a whole tensor or all of them: wrong on a shard, and why.
WHOLE_TENSOR = {
    "LBFGS": "its line search and curvature history treat all parameters as one vector",
    "SparseAdam": "it updates whole rows of sparse gradients",
    "Adafactor": "it factors each tensor's second moment into row and column statistics",
    "LAMB": "its trust ratio is a per-layer norm", "Lamb": "its trust ratio is a per-layer norm",
    "LARS": "its trust ratio is a per-layer norm", "Lars": "its trust ratio is a per-layer norm",
}


def check_elementwise(cls: type, elementwise: bool | None) -> None:
    """ValueError unless `cls`'s update is element-wise (known to be, or `elementwise=True`)."""
    name = getattr(cls, "__name__", repr(cls))
    if name in WHOLE_TENSOR and not elementwise:
        raise ValueError(f"{name} cannot run on a shard: {WHOLE_TENSOR[name]}; use shard=\"none\", or an "
                         f"element-wise optimizer ({', '.join(ELEMENTWISE[:4])}, ...)")
    if elementwise is None and not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
                                    and name in ELEMENTWISE and cls.__module__.startswith("torch.optim")):
        raise ValueError(f"{name} is not a torch optimizer known to update element by element, so its update on a "
                         "shard may differ from the whole model's; pass elementwise=True if each element's update "
                         "reads only that element's gradient and state, or use shard=\"none\"")


def _groups(params: Any, module: nn.Module) -> list[dict]:
    """`params` as torch takes it (None: the module's), normalised to a list of group dicts."""
    if params is None:
        return [{"params": list(module.parameters())}]
    if isinstance(params, torch.Tensor):
        raise TypeError("params should be an iterable of parameters or of param-group dicts, not a tensor")
    items = list(params)
    if items and isinstance(items[0], dict):
        return [{**group, "params": list(group["params"])} for group in items]
    return [{"params": items}]


def make_optimizer(dp, cls: type, params: Iterable | None = None, *, elementwise: bool | None = None,
                   **defaults: Any) -> torch.optim.Optimizer:
    """`cls` over `dp`'s parameters (or `params`, as torch takes them), sharded when `dp` is."""
    sharding = dp.sharding
    if sharding is None:
        optimizer = cls(params if params is not None else dp.module.parameters(), **defaults)
        if dp.exchanging:  # gradients live in the buckets: zero them there, never drop the views
            optimizer.zero_grad = lambda set_to_none=True: dp.zero_grad(set_to_none=set_to_none)
        return optimizer
    check_elementwise(cls, elementwise)
    owned, group_names, params_of = [], [], []

    def pieces_of(group: dict) -> tuple[dict, list, list[str]]:  # this rank's pieces of a group's parameters
        found_pieces, names = [], []
        for param in group["params"]:
            if not param.requires_grad:  # frozen: no bucket, never a gradient; torch's optimizer skips it too
                continue
            found = sharding.piece(param)
            names.append(found.slot.name if found is not None else sharding.layout.name_of(param))
            if found is not None:
                found_pieces.append((nn.Parameter(found.values, requires_grad=True), found, param))
        for piece, found, _ in found_pieces:
            piece.grad = found.grad
        return {**group, "params": [piece for piece, _, _ in found_pieces]}, found_pieces, names

    def note(found_pieces: list, names: list[str]) -> None:
        owned.extend((piece, found) for piece, found, _ in found_pieces)
        params_of.extend(param for _, _, param in found_pieces)
        group_names.append(names)

    groups = []
    for group in _groups(params, dp.module):
        mine, found_pieces, names = pieces_of(group)
        groups.append(mine)
        note(found_pieces, names)
    optimizer = cls(groups, **defaults)
    share = {"rank": dp.world.rank, "world_size": dp.world.world_size, "shard": dp.shard,
             "pieces": [(found.slot.name, found.start, found.stop) for _, found in owned]}
    # What the sharded checkpoint needs: each piece and where it lies, each group's parameter names.
    sharding.optimizers[optimizer] = ShardedOptimizerRecord(pieces=owned, group_names=group_names, share=share)
    optimizer.register_state_dict_post_hook(lambda _, state: {**state, SHARE_KEY: share})
    optimizer.register_load_state_dict_pre_hook(lambda _, state: _checked_share(state, share))
    sharded = ShardedOptimizerHooks(dp, [(piece, found.grad, param)
                                         for (piece, found), param in zip(owned, params_of)])
    optimizer.register_step_pre_hook(sharded.before_step)
    optimizer.register_step_post_hook(sharded.after_step)
    agree_on_overflow(optimizer, dp, sharded.attach)  # a GradScaler's unscale_: the pieces' gradients, every range
    plain_add_param_group = optimizer.add_param_group

    def add_param_group(group: dict) -> None:
        """A group added mid-run (a backbone unfrozen, a new head) gets this rank's pieces too: its
        whole parameters would step with gradients summed only in this rank's range."""
        if not isinstance(group, dict):
            return plain_add_param_group(group)  # torch's own error
        group = {**group, "params": [group["params"]] if isinstance(group["params"], torch.Tensor)
                 else list(group["params"])}
        held = {id(param) for param in params_of}
        if any(id(p) in held for p in group["params"]):
            raise ValueError("some parameters appear in more than one parameter group of this sharded optimizer; "
                             "add each parameter to one group only")
        mine, found_pieces, names = pieces_of(group)
        plain_add_param_group(mine)
        note(found_pieces, names)
        share["pieces"].extend((found.slot.name, found.start, found.stop) for _, found, _ in found_pieces)
        for piece, found, param in found_pieces:
            sharded.add(piece, found.grad, param)

    optimizer.add_param_group = add_param_group
    # Stage 1 keeps whole gradient buckets that backward adds into: zeroing only this rank's
    # pieces would leave the rest summing up across steps, so the optimizer's zero_grad is the
    # replica's (which zeroes every bucket) as well.
    plain_zero_grad = optimizer.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        plain_zero_grad(set_to_none=set_to_none)
        dp.zero_grad(set_to_none=set_to_none)

    optimizer.zero_grad = zero_grad
    return optimizer


@dataclass(frozen=True)
class ShardedOptimizerRecord:
    """A sharded optimizer's pieces, each with where it lies (stages.py's OwnedPiece), the
    parameter names of each of its groups (all of them, also those other ranks own), and the
    share its state_dict is tagged with."""

    pieces: list
    group_names: list[list[str]]
    share: dict


SHARE_KEY = "phalanx_share"
_WAYS = ("save and load with phalanx.checkpoint / phalanx.resume (they reshard across device counts), "
         "or have each rank save and load its own optimizer.state_dict() (a file per rank)")


def _checked_share(state: dict, share: dict) -> dict:
    """`state` without its tag, if it is this optimizer's share; else one line naming what it is."""
    theirs = state.get(SHARE_KEY)
    mine = f"rank {share['rank']}'s share of the optimizer state (shard={share['shard']!r})"
    if theirs is None:
        raise ValueError(f"this optimizer holds {mine}, and the state_dict given has no share tag: it is a whole "
                         f"optimizer's or another program's; {_WAYS}")
    if (theirs["world_size"], theirs["shard"]) == (share["world_size"], share["shard"]) \
            and theirs["rank"] != share["rank"]:
        raise ValueError(f"this optimizer holds {mine}, but the state_dict given is rank {theirs['rank']}'s: "
                         f"each rank's share is its own; {_WAYS}")
    if theirs != share:
        raise ValueError(f"this optimizer holds {mine} of {share['world_size']} rank(s), but the state_dict given "
                         f"is a share cut for {theirs['world_size']} rank(s), shard={theirs['shard']!r}, or another "
                         f"model; {_WAYS}")
    return {key: value for key, value in state.items() if key != SHARE_KEY}


class ShardedOptimizerHooks:
    """The step of a sharded optimizer: its pieces' gradients attached (a `zero_grad` that set
    them to None does not lose the summed shard), no exchange pending; then the all-gather."""

    def __init__(self, dp, pieces: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
        self._dp = weakref.ref(dp)
        self._pieces = pieces  # (piece, its summed shard gradient, its parameter)

    def add(self, piece: nn.Parameter, grad: torch.Tensor, param: nn.Parameter) -> None:
        """A piece of a param group added after the optimizer was made."""
        self._pieces.append((piece, grad, param))

    def before_step(self, optimizer, args, kwargs) -> None:
        dp = self._dp()
        if dp is None:
            return
        if dp.exchange_in_flight:
            raise Misuse("optimizer.step() while gradient reduce-scatters are in flight; call "
                         "dp.finish_gradient_sync() first")
        dp.check_synced("optimizer.step()")
        if dp.sharding is not None:  # a parameter cut loose from the flat buffer would not train
            dp.sharding.params.check_outside_whole("optimizer.step()", "step before the block, whose reads (an "
                                                   "EMA's update, a logged norm) then see the stepped weights")
            dp.sharding.params.refuse_replaced()
        self.attach()

    def attach(self) -> None:
        """Each piece's summed shard gradient as its `.grad` again (a set_to_none `zero_grad` let go
        of it): before the step, and before a GradScaler's `unscale_`, which reads `.grad` too."""
        dp = self._dp()
        if dp is None:
            return
        unused = dp.unused_at_last_sync  # no rank used them: skipped, as torch skips a gradient of None
        for piece, grad, param in self._pieces:
            if id(param) in unused:
                piece.grad = None
            elif piece.grad is None:
                piece.grad = grad

    def after_step(self, optimizer, args, kwargs) -> None:
        dp = self._dp()
        if dp is not None and dp.sharding is not None:
            dp.sharding.gather_after_step()


class WholeOptimizerGuard:
    """Refuses a torch optimizer built over a sharded replica's own parameters (the DDP habit
    `AdamW(dp.parameters())`): it would keep whole state and step with gradients that are summed
    only in this rank's range. Process-wide hook (replica_hook.py), looked up again when a group is added.
    torch's clip_grad_norm_ / clip_grad_value_ over them, wrong for the same reason, is refused
    too (torch_clip.py)."""

    def __init__(self, module: nn.Module, stage: str) -> None:
        self._module, self._stage = module, stage
        self._seen = OptimizerVerdicts()  # does it step the replica's whole parameters?
        self._handle = on_every_optimizer_step(self.check)
        self._clip = TorchClipGuard({id(p) for p in module.parameters()}, stage)

    def check(self, optimizer: torch.optim.Optimizer) -> None:
        if self._seen.of(optimizer, lambda judged: steps_replica(judged, self._module, None)):
            raise Misuse(f"this optimizer steps the replica's whole parameters, but shard={self._stage!r} "
                         "sums each rank's gradient range only; build it with dp.optimizer("
                         f"{type(optimizer).__name__}, ...) instead of {type(optimizer).__name__}(dp.parameters(), ...)")

    def close(self) -> None:
        self._handle.remove()
        self._clip.close()
