"""Parameters a step leaves out, and parameters frozen or unfrozen mid-run: 1 device's update all the same.

On one device a parameter that took no part in a step's backward keeps the gradient it had:
`.grad = None` after `zero_grad()`, and every torch optimizer skips it (no weight decay, no
momentum, no Adam moment); a zero tensor after `zero_grad(set_to_none=False)` (or a
`p.grad.zero_()` loop), which the optimizer steps like any other. In a replica its gradient is a
view into a bucket: zero, not None, so SGD with momentum or decay and Adam would move it, and k
devices would train another model than 1 (an auxiliary head used on some steps, a branch a batch
does not reach, layers frozen after `prepare`). DDP has the same rule behind
`find_unused_parameters=True` (pytorch#28294): it sums a bitmap of what each rank used, and
leaves the gradient of a parameter no rank used untouched.

`ParameterUsage` does it without a collective of its own. Landing hooks record what this rank's
backwards (synced or under `no_sync`) used. Just before the last bucket goes out - by then
every gradient this rank will produce has landed: overlap launches the last bucket only once
every bucket is complete, and otherwise `finish()` launches it after backward - each rank
writes one flag per parameter, 1.0 where it used it or holds a gradient from before this
backward (`none` tells which count as None: all after `zero_grad()`, those dropped at the last
sync after `zero_grad(set_to_none=False)`), into elements that sit after the last bucket's
gradients and ride in its allreduce. After the sum a flag of 0 means no rank used the parameter
and none held a gradient for it (a sum of non-negative numbers is 0 only if every term is, also
when compressed to bf16/fp16). Those gradients become None on every rank alike; a parameter no
rank used but some held a gradient for keeps its slot, the sum of what the ranks held (zeros
after `zero_grad(set_to_none=False)`), on every rank alike. A rank that used every parameter
knows without reading that none is unused globally, so the flags are read (on a GPU: one
device-to-host copy) only on a rank that left some out. A dropped gradient stays None
through `zero_grad()`, as torch's does (`zero_grad(set_to_none=False)` makes it its zeroed slot, for
gradients written in by hand), and is its view again when the parameter lands, or at the next sync.

The same flags tell a skipped backward: a rank whose grad-enabled forward took examples since the
last sync but whose gradients never landed (`if rank == 0: loss.backward()`) gives the sum
nothing, and a flag above 0 says a peer's backward did. DDP hangs there; summing on would train
on the other ranks' shards only, so `left_out_rows` has the layout refuse it after the sync's
collectives. An empty shard's forward and a sync every rank makes without a backward are one
device's step too, and pass.

Parameters frozen when the replica is made have no bucket and no flag (layout.py lays the
buckets out again when `requires_grad` changes).

The landing is also where a write into the gradients before their sum is seen. Each bucket's
version counter (torch bumps it at every in-place write through any of its views) is noted at
its last landing, and at its launch after the flags are written, and forgotten once summed (a
write after the sum, a clip or average=True's division, is no write before it). The exchange sends an alias
with a counter of its own, so no sum moves it. At the sync, a counter moved since then means
the script wrote into unsummed gradients: `torch.nn.utils.clip_grad_norm_` before
`finish_gradient_sync()` clips each rank's share by its own norm, which is not the clip of the
sum (and races the wire where buckets went out beside backward). `written()` names such buckets.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from phalanx.data_parallel.buckets import Bucket, grad_view
from phalanx.errors import UsageError


class ParameterUsage:
    """What one rank's backwards used since the last sync, and the gradients dropped at it."""

    def __init__(self, buckets: Sequence[Bucket], *, rides: bool = True, views: bool = True,
                 none: Sequence[nn.Parameter] | None = None) -> None:
        """`rides`: `buckets` were laid out with one spare element per parameter after the last
        one's gradients (`build_buckets(..., spare=usage_elements(...))`), where the flags ride.
        Otherwise (sharded: a reduce-scatter leaves no rank every flag) the flags are a tensor of
        their own that the replica allreduces after the buckets, and no gradient is dropped here:
        `unused` tells the sharded optimizer which pieces to skip. `views`: the gradients are
        views of the buckets (not under sharding's stages 2 and 3, which copy them in at launch).
        `none`: the parameters whose gradient was None before the buckets were laid out (None: all)."""
        self.params = [param for bucket in buckets for param in bucket.params]
        self.rides = rides
        slots = rides or views  # each gradient has a slot in a bucket: its view, version and zeroing noted
        last = buckets[-1]
        self._views = {id(param): grad_view(bucket.buffer, offset, param) for bucket in buckets
                       for param, offset in zip(bucket.params, bucket.offsets)} if slots else {}
        for param in self.params if rides else ():  # .grad *is* the view from now on: one identity test a landing
            view = self._views[id(param)]
            if param.grad is not None and _is_view_of(param.grad, view):
                param.grad = view
        self.flags = last.storage[last.buffer.numel():] if rides else \
            torch.ones(len(self.params), dtype=last.buffer.dtype, device=last.buffer.device)
        self.unused: set[int] = set()  # id(param) of each parameter no rank used at the last sync
        # id(param) of each gradient that counts as None until it lands, though it may be a slot
        # (zero_grad() keeps the views): the optimizer of one device would skip it.
        self.none: set[int] = set(map(id, self.params if none is None else none))
        if self.flags.numel() != len(self.params):
            raise ValueError(f"the last bucket has {self.flags.numel()} spare elements "
                             f"for {len(self.params)} parameters")
        self._used: set[int] = set()  # id(param) of each parameter whose gradient landed, or that holds one
        self._added = False  # a gradient landed onto its slot's contents since the last sync (`added`)
        self._forward_rows = 0  # examples the replica's grad-enabled forwards took since the last sync
        self.left_out_rows = 0  # set at a sum to which this rank's forward gave nothing, peers' backwards did
        self.dropped: list[nn.Parameter] = []  # gradients set to None at the last sync
        self._script_dropped: list[nn.Parameter] = []  # set to None by the script after landing: dropped after the sum
        self._buffers = [bucket.buffer for bucket in buckets] if slots else []
        self._bucket_at = {id(param): bucket.index for bucket in buckets for param in bucket.params} if slots else {}
        self._versions: list[int | None] = [None] * len(self._buffers)  # each bucket's counter when last written here
        self._zeroed: list[int | None] = [None] * len(self._buffers)  # each bucket's counter after zero_grad zeroed it

    def landed(self, param: nn.Parameter) -> None:
        """A landing hook's note: `param`'s gradient accumulated. Where its .grad was None (dropped at
        the last sync, or set so by `optimizer.zero_grad()`), autograd made a fresh tensor: it goes
        into the bucket, over whatever the slot held."""
        self._used.add(id(param))
        view = self._views.get(id(param)) if self.rides else None  # (sharded: refused at the sync instead)
        if view is not None:
            if param.grad is not view:
                _take_back(param, view)
            else:
                self._added = True
            self._versions[self._bucket_at[id(param)]] = view._version

    def forwarded(self, inputs: Sequence[object]) -> None:
        """At the replica's forward: with grad enabled, the examples it takes (the first tensor's rows)."""
        if torch.is_grad_enabled():
            first = next((item for item in inputs if isinstance(item, torch.Tensor)), None)
            self._forward_rows += 1 if first is None or first.dim() == 0 else first.shape[0]

    def zeroed(self) -> None:
        """After zero_grad zeroed every bucket: their counters, so a write into a slot whose
        gradient never lands (`p.grad.copy_(g)`) is told from a slot nothing touched."""
        self._zeroed = [buffer._version for buffer in self._buffers]

    def noted(self, index: int | None = None) -> None:
        """Bucket `index` (None: every bucket) written by the replica itself: its counter as it is now."""
        for i in range(len(self._buffers)) if index is None else (index,):
            self._versions[i] = self._buffers[i]._version

    def written(self) -> list[nn.Parameter]:
        """At the sync: the parameters of each bucket written since its last landing or launch (see
        the module docstring), then nothing noted until the next landing."""
        moved = [i for i, (buffer, seen) in enumerate(zip(self._buffers, self._versions))
                 if seen is not None and buffer._version != seen]
        self._versions = [None] * len(self._buffers)
        return [param for param in self.params if self._bucket_at[id(param)] in moved] if moved else []

    @property
    def landed_any(self) -> bool:
        """Whether some gradient landed on this rank since the last sync (or zero_grad)."""
        return bool(self._used)

    @property
    def added(self) -> bool:
        """Whether a gradient landed since the last sync (or zero_grad) by adding onto what its slot held,
        not as a fresh tensor (its .grad None before); sharded, whether any landed."""
        return self._added if self.rides else bool(self._used)

    def _not_landed(self) -> list[int]:
        """Positions of the parameters whose gradient did not land on this rank (none: no loop)."""
        if len(self._used) == len(self.params):
            return []
        return [i for i, param in enumerate(self.params) if id(param) not in self._used]

    def write_flags(self) -> None:
        """Before the last bucket's launch: 1.0 for each parameter this rank used or holds a
        gradient for (`take_back`), 0.0 for the rest."""
        self.flags.fill_(1.0)
        unused = self._not_landed()
        if unused:
            self.flags[unused] = 0.0

    def after_sum(self) -> list[nn.Parameter]:
        """After every bucket's sum (and the flags'): each parameter no rank used or held a
        gradient for, its gradient dropped where the flags rode (else only noted in `unused`);
        return them. Until the next sync those count as None, the rest as the tensors they are."""
        nobody = []
        unused = self._not_landed()
        if unused:
            summed = self.flags[unused].tolist()
            nobody = [self.params[i] for i, total in zip(unused, summed) if total == 0]
        self.unused = set(map(id, nobody))
        # A forward with examples, no gradient of this rank's in the sum, some peer's in it: a skipped
        # backward (`if rank == 0: loss.backward()`), not an empty shard, nor a sync every rank made alike.
        self.left_out_rows = self._forward_rows if not self._used and len(nobody) < len(self.params) else 0
        self._forward_rows = 0
        if self.rides and (nobody or self._script_dropped):
            self.drop([*nobody, *self._script_dropped])
        self.none = self.unused | set(map(id, self._script_dropped))
        self._script_dropped = []
        self._used.clear()
        self._added = False
        # Summed now: a write from here on (a clip after the sync, average=True's division) is into
        # the sum, not before it. Until a landing or launch notes a counter again, a sync with no
        # backward since this one finds nothing written (it sums the same gradient again).
        self._versions = [None] * len(self._buffers)
        return nobody

    def drop(self, params: Sequence[nn.Parameter]) -> None:
        """Set these parameters' gradients to None, as a sync that found no rank used them would."""
        for param in params:
            param.grad = None
        self.dropped = list(params)

    def restore(self, *, set_to_none: bool = True) -> None:
        """From zero_grad: with `set_to_none` a dropped gradient stays None and every gradient counts as
        None, as torch's zero_grad() leaves them (DCP's template reads a gradient as "stepped"); without,
        a dropped gradient is its zeroed slot again, still counted as None, for a script that writes its
        gradients into the slots by hand (`p.grad.copy_(g)`)."""
        if set_to_none:  # (still dropped: a later zero_grad(set_to_none=False) may make them slots)
            self.none = set(map(id, self.params))
            return
        for param in self.dropped:
            if param.grad is None:
                param.grad = self._views[id(param)]
                self.none.add(id(param))
        self.dropped = []

    def take_back(self) -> None:
        """Before a sync (after `written`): each gradient that did not land since the last one (a
        landing takes its own back) a view of its slot again - None (dropped at the last sync, or
        set so by `optimizer.zero_grad()`) a zeroed slot, so no stale sum goes out; a gradient
        held from before (not in `none`: `zero_grad(set_to_none=False)`'s zeros, or the last sum)
        and one the script set by hand counted as used, as one device's optimizer would step it: another
        tensor put there (`p.grad = g`, from `torch.autograd.grad`) copied in, or its slot written
        in place since zero_grad zeroed it (`p.grad.copy_(g)`: read only where that bucket's
        counter moved, and a slot left all zero counts as unused). Sharded, the script's tensor
        counts as used too (stage 1 copies it into its bucket; stages 2 and 3 send `.grad` as it
        is), and a None stays (a torch optimizer's zero_grad over a sharded replica: refused at the
        sync). A parameter frozen since keeps what it has. Nothing to do when all landed."""
        in_place = []  # slots of gradients that did not land, in buckets written since zero_grad
        for index in self._not_landed():
            param = self.params[index]
            view = self._views.get(id(param))
            if not param.requires_grad:
                continue
            held = id(param) not in self.none
            if _in_slot(param.grad, view):
                at = self._bucket_at[id(param)]
                if held:
                    self._used.add(id(param))
                elif self._buffers[at]._version != self._zeroed[at]:
                    in_place.append((param, view))
                continue
            if param.grad is not None or (held and view is None):  # (stages 2, 3: the shard holds it)
                self._used.add(id(param))
            elif not self.rides:
                continue
            if view is not None:
                _take_back(param, view)
        if in_place:  # one read for all of them (on a GPU, one device-to-host copy)
            written = torch.stack([view.any() for _, view in in_place]).tolist()
            self._used.update(id(param) for (param, _), wrote in zip(in_place, written) if wrote)
        self.dropped = []

    def unaliased(self) -> nn.Parameter | None:
        """After the exchange, where some gradient is no longer its slot: one the script set to None
        after it landed (to skip it this step) is its slot again until the sum is done, then
        dropped (`after_sum`), as one device's optimizer skips it; returns the first parameter whose
        gradient is some other tensor (replaced after its bucket was sent), or None. Sharded
        replicas explain nothing here: their first parameter not aliasing its slot."""
        replaced = None
        for param in self.params:
            view = self._views.get(id(param))
            if view is None or not param.requires_grad or _in_slot(param.grad, view):
                continue
            if param.grad is None and self.rides:
                param.grad = view
                self._script_dropped.append(param)
            elif replaced is None:
                replaced = param
        return replaced

    def forget(self) -> None:
        """A step given up (zero_grad without a sync): its landings count for nothing."""
        self._used.clear()
        self._added = False
        self._versions = [None] * len(self._buffers)


def _in_slot(grad: torch.Tensor | None, view: torch.Tensor | None) -> bool:
    """Whether `grad` is its bucket slot `view`: the view itself, or (sharded) another view of it."""
    return view is not None and grad is not None and (grad is view or _is_view_of(grad, view))


def _is_view_of(grad: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether `grad` lies where `view` does; a sparse gradient (an embedding's) never does."""
    return grad.layout == torch.strided and grad.data_ptr() == view.data_ptr()


@torch.no_grad()
def _take_back(param: nn.Parameter, view: torch.Tensor) -> None:
    """`param`'s gradient into its bucket slot `view`, and `.grad` that view: None is a zero slot,
    a sparse gradient (an embedding's with `sparse=True`, autograd's own where `.grad` was None) is
    added into a zeroed slot: summed dense, made sparse again after the sum (sparse.py)."""
    grad = param.grad
    if grad is None:
        view.zero_()
    elif grad.layout != torch.strided:
        view.zero_().add_(grad)
    elif grad.data_ptr() != view.data_ptr():
        view.copy_(grad)
    param.grad = view


def usage_elements(params: Sequence[nn.Parameter]) -> int:
    """The spare elements the last bucket carries: one flag per trainable parameter."""
    return sum(1 for param in params if param.requires_grad)



class SkippedBackward(UsageError, RuntimeError):
    """A rank's forward gave the sum nothing while its peers' backwards did (`skipped_backward`)."""


def skipped_backward(rows: int, rank: int) -> SkippedBackward:
    """The one-line refusal of a sync to which `rank`'s forward of `rows` examples gave no gradient."""
    return SkippedBackward(
        f"rank {rank}'s forward took {rows} example(s) since the last sync, but no backward reached the replica's "
        "parameters before finish_gradient_sync() while another rank's did: its shard is left out of the sum, "
        "which is then not one device's gradient of the global batch (DDP would hang here); call backward on "
        "every rank, and where a rank means to skip its shard, backpropagate 0 * loss (or run that forward "
        "under torch.no_grad())")
