"""The gradient buckets, laid out for the parameters that train now, and again when that changes.

Fine-tuning freezes layers and unfreezes them later (gradual unfreezing), or freezes a head after
a warm-up. DDP lays its buckets out once, at construction: a parameter unfrozen later is never
summed, so each rank trains its own copy of it, and one frozen later is waited for until the
"expected to have finished reduction" error (unless `find_unused_parameters=True`). Here the
replica compares each parameter's `requires_grad` with the layout's at `zero_grad()` and after
each sync, and lays the buckets out again for the new set:

- a parameter frozen since loses its gradient as `optimizer.zero_grad()` would drop it on one
  device (frozen inside a step, after its backward: it keeps a copy of the summed one);
- a parameter unfrozen after this step's `zero_grad()` already holds a gradient no bucket
  summed: `sum_newly_trainable` sums it in one allreduce of its own (with a used-flag each, so
  what no rank reached stays None, as usage.py does for the buckets), then the new layout
  takes it in.

Every rank flips `requires_grad` at the same point of its loop (the script is the same), so
every rank lays out the same buckets; a rank that does not issues a different collective, which
the call board names. Sharded replicas lay out their shards once and refuse the change.

A parameter added to the model after prepare (a head appended, a layer replaced) has no bucket:
each rank would train its own copy, silently (DDP's too). It is refused at the next `zero_grad()`
or sync, naming it and the fix (prepare again). Seeing it costs nothing per step: torch's global
registration hooks count every parameter and submodule registered in the process, and only
when the count moved are the module's parameters compared with the layout's.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn
from torch.nn.modules.module import (register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)

from phalanx.data_parallel.buckets import Bucket, build_buckets, default_first_cap_bytes, mb_to_bytes
from phalanx.data_parallel.carry import CarriedSum
from phalanx.data_parallel.sparse import sparse_gradients
from phalanx.data_parallel.usage import ParameterUsage, skipped_backward, usage_elements
from phalanx.errors import UsageError
from phalanx.runtime.world import World


class BucketLayout:
    """`module`'s trainable parameters in buckets (buckets.py) of at most `bucket_cap_mb` (the
    first: `first_bucket_cap_mb`, None: DDP's rule), and the `usage` flags (usage.py: after the
    last one, or apart under `shard`); laid out again for the parameters that train now when that changes."""

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float | None, first_bucket_cap_mb: float | None,
                 shard: str, world: World | None = None, average: bool | None = None) -> None:
        # A sum carried into the next step without zero_grad, kept once over `world`'s ranks (carry.py; stages 2
        # and 3: sharding/stages.py); one rank (or no world given) keeps all of it, with nothing to do.
        many = world is not None and world.world_size > 1
        self.carry = CarriedSum(rank=world.rank if many else 0, scale=world.world_size if many and average else 1,
                                carry=many and (shard == "optimizer" or shard == "none" and not average))
        self._added = AddedParameters(module)
        self.module, self.params, self._shard = module, self._added.params, shard
        cap_bytes = mb_to_bytes(bucket_cap_mb)
        first = default_first_cap_bytes(cap_bytes) if first_bucket_cap_mb is None else mb_to_bytes(first_bucket_cap_mb)
        self._caps = dict(cap_bytes=cap_bytes, first_cap_bytes=first)
        self.bucket_cap_mb = bucket_cap_mb  # what the run's first log line names (choices.py)
        self.usage: ParameterUsage | None = None
        self._left_out_rows = 0  # a skipped backward's examples, refused once the sync's collectives are done
        self._rank = world.rank if world is not None else 0
        self._lay_out()

    def _lay_out(self) -> None:
        """`buckets`, `usage` and `laid_out` for the parameters that train now."""
        self.laid_out = [param.requires_grad for param in self.params]
        rides = self._shard == "none"  # a sharded bucket is reduce-scattered: no rank would hold every flag
        views = self._shard in ("none", "optimizer")  # stages 2 and 3 copy the gradients in at launch
        # Gradients None now, or counted so though views (zero_grad()): views from here on, None all the same.
        counted = self.usage.none if self.usage is not None else set()
        none = [param for param in self.params if param.grad is None or id(param) in counted]
        self.buckets = build_buckets(self.params, **self._caps, gradient_views=views,
                                     spare=usage_elements(self.params) if rides else 0)
        first = self.usage is None
        self.usage = ParameterUsage(self.buckets, rides=rides, views=views, none=none) if self.buckets else None
        if first and rides and self.usage is not None:  # as one device's before its first backward: None until
            # they land or zero_grad(set_to_none=False) makes them zeroed slots (usage.py); a frozen parameter has none
            self.usage.drop([param for param in none if param.requires_grad])
        # Sparse gradients made sparse again after the sum (sparse.py); sharded, the optimizer steps dense ranges.
        self.sparse = sparse_gradients(self.module, self.buckets) if rides else None

    def check_added(self) -> None:
        """Refuse a parameter the module gained since prepare (module docstring)."""
        self._added.checked()

    def before_step(self, *, set_to_none: bool = True) -> bool:
        """From zero_grad: lay out again if `requires_grad` changed, and every gradient a bucket
        view again (counted as None with `set_to_none`, usage.py); True when laid out again (the
        caller wires the new buckets)."""
        self.check_added()
        self.carry.cleared()
        again = self.changed
        if again:
            self.again(in_step=False)
        if self.usage is not None:
            self.usage.restore(set_to_none=set_to_none)
            self.usage.forget()
        return again

    def zero(self) -> None:
        """Zero every bucket (the replica's zero_grad), the usage notes told."""
        for bucket in self.buckets:
            bucket.buffer.zero_()
        if self.usage is not None:
            self.usage.zeroed()
        if self.sparse is not None:
            self.sparse.zeroed()

    def sparse_hooks(self) -> list:
        """The hooks that note the sparse gradients' rows (sparse.py), none without such gradients."""
        return self.sparse.hooks() if self.sparse is not None else []

    def end_sync(self, allreduce: Callable[[torch.Tensor], object]) -> None:
        """The sync's last part, on every rank: after the sum (and any averaging) each sparse gradient sparse
        again (sparse.py); then, its collectives done, a shard this rank's skipped backward left out is refused."""
        if self.sparse is not None:
            self.sparse.after_sum(allreduce)
        rows, self._left_out_rows = self._left_out_rows, 0
        if rows:
            raise skipped_backward(rows, self._rank)

    def before_forward(self, inputs: Sequence[object]) -> None:
        """At the replica's forward (`inputs`: its arguments): the examples noted for the sync (usage.py);
        a sum carried from the last step kept once from here (carry.py)."""
        if self.usage is not None:
            self.usage.forwarded(inputs)
        if self.carry.armed:
            self.carry.before_forward([p for b in self.buckets for p in b.params], self._open_carried)

    def _open_carried(self) -> None:
        """The next backward adds into the carried sum: this rank zeroes what it does not keep (carry.py)."""
        self.carry.zero(self.buckets)
        if self.sparse is not None and self.carry.rank != 0:
            self.sparse.slots_again()

    def take_back(self) -> None:
        """Before a sync: every gradient its bucket slot again (usage.py), the sparse ones' rows noted first;
        a carried sum this rank's step never opened (no backward here) kept once (carry.py)."""
        usage = self.usage
        self.carry.before_sum(landed=usage is not None and usage.landed_any, added=usage is not None and usage.added,
                              open_=self._open_carried)
        if self.sparse is not None:
            self.sparse.before_sum()
        if self.usage is not None:
            self.usage.take_back()

    def after_sum(self, allreduce: Callable[[torch.Tensor], object]) -> bool:
        """After every bucket's sum: drop what no rank used; parameters unfrozen since the step's
        zero_grad summed by `allreduce`, then laid out again (True: the caller wires the new buckets).
        Sharded, the usage flags are summed by `allreduce` too: they rode in no bucket."""
        self.check_added()
        self.carry.synced()
        if self.usage is not None:
            if not self.usage.rides:
                self.usage.write_flags()
                allreduce(self.usage.flags)
            self.usage.after_sum()
            self._left_out_rows = self.usage.left_out_rows
        if not self.changed:
            return False
        self._refuse_if_sharded()
        self.sum_newly_trainable(allreduce)
        self.again(in_step=True)
        return True

    @property
    def changed(self) -> bool:
        """Whether some parameter's `requires_grad` differs from the layout's (a loop over the parameters)."""
        return [param.requires_grad for param in self.params] != self.laid_out

    def _refuse_if_sharded(self) -> None:
        if self._shard != "none":
            raise UsageError(f"{self.first_change()}.requires_grad changed after prepare(shard={self._shard!r}), whose "
                             "shards are laid out once; set requires_grad before prepare, or prepare without shard=")

    def first_change(self) -> str:
        """The name of the first parameter whose `requires_grad` changed, for an error message."""
        return next(name for (name, param), was in zip(self.module.named_parameters(), self.laid_out)
                    if param.requires_grad != was)

    def again(self, *, in_step: bool) -> list[Bucket]:
        """Buckets for the parameters that train now; their gradients' values move with them, and
        one that has none (no rank used it, or it was unfrozen and nobody reached it) stays without."""
        self._refuse_if_sharded()
        for param, was in zip(self.params, self.laid_out):
            if was and not param.requires_grad:
                param.grad = param.grad.clone() if in_step and param.grad is not None else None
        without = [param for param in self.params if param.requires_grad and param.grad is None]
        sparse = self.sparse
        self._lay_out()  # (every trainable parameter's gradient a view of the new buckets)
        if self.usage is not None:
            self.usage.drop(without)
        if self.sparse is not None:
            self.sparse.adopt(sparse if in_step else None)
        return self.buckets

    def sum_newly_trainable(self, allreduce: Callable[[torch.Tensor], object]) -> None:
        """Sum the gradients of parameters unfrozen after this step's buckets were laid out."""
        sum_newly_trainable([p for p, was in zip(self.params, self.laid_out) if p.requires_grad and not was], allreduce)


class AddedParameters:
    """`module`'s parameters as prepare found them, and the refusal of one registered since
    (module docstring): the buckets' check, and a world of one's, whose `zero_grad` clears these."""

    def __init__(self, module: nn.Module) -> None:
        _count_registrations()
        self.module, self.params = module, list(module.parameters())
        self._registrations = _REGISTRATIONS[0]

    def checked(self) -> list[nn.Parameter]:
        """The parameters, once none was added since prepare (a loop over them only when some
        registration anywhere in the process moved the count)."""
        if _REGISTRATIONS[0] == self._registrations:
            return self.params
        self._registrations = _REGISTRATIONS[0]
        known = {id(param) for param in self.params}
        added = next((name for name, param in self.module.named_parameters() if id(param) not in known), None)
        if added is not None:
            raise UsageError(f"parameter {added} was added to the model after prepare (a layer appended or replaced, "
                             "load_state_dict(assign=True)): no gradient bucket holds it, so each rank would train "
                             "its own copy; prepare again once the model has it (dp.close(); "
                             "dp = phalanx.prepare(dp.module, world=world)) and build the optimizer over its "
                             "parameters")
        return self.params


def sum_newly_trainable(params: Sequence[nn.Parameter], allreduce: Callable[[torch.Tensor], object]) -> None:
    """`params`' gradients summed by one `allreduce(flat)` (float64, one used-flag per parameter at
    its end): a parameter no rank's backward reached stays None, the rest hold the sum."""
    if not params:
        return
    device = params[0].device
    pieces = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).to(device, torch.float64)
              for p in params]
    used = torch.tensor([float(p.grad is not None) for p in params], dtype=torch.float64, device=device)
    flat = torch.cat([*pieces, used])
    allreduce(flat)
    offset = 0
    for param, total in zip(params, flat[-len(params):].tolist()):
        piece = flat[offset:offset + param.numel()]
        offset += param.numel()
        param.grad = None if total == 0 else piece.view_as(param).to(param.dtype)


_REGISTRATIONS = [0]  # parameters and submodules registered on any module of this process, counted
_COUNTING: list = []  # the two global hooks' handles, once installed


def _count_registrations() -> None:
    """Install, once, torch's global hooks that count registrations (`check_added`)."""
    if _COUNTING:
        return

    def count(*_) -> None:
        _REGISTRATIONS[0] += 1

    _COUNTING.extend([register_module_parameter_registration_hook(count),
                      register_module_module_registration_hook(count)])
