"""Checks that turn a silent distributed failure into an error naming the rank, field and step.

- `preflight_check`: before the first step every rank contributes a fingerprint of what must
  agree (model parameters, bucket layout, world settings, steps per epoch); one all-gather, and
  a rank that differs is named with the field - instead of a hang when, say, one rank's model has
  an extra layer and issues one collective more.
- `check_replicas`: every N steps the replicas' parameter and buffer checksums (float64 per
  tensor) are gathered and compared bitwise: data parallelism keeps replicas identical, so any
  difference is a bug (a rank that skipped an update, a non-deterministic reduction) or a buffer
  that follows each rank's own data (running statistics nobody averages), caught at the step it
  shows instead of at the end of training - or, with `buffers_only`, before an evaluation that
  would otherwise mix diverged replicas.
- `check_finite`: the loss and the summed gradients must be finite; a NaN/Inf stops the run at
  its step and rank instead of silently poisoning every replica.
- `gradients_detached`: the refusal when a `.grad` no longer aliases its bucket at a sync of a
  sharded replica, naming the cause (a torch optimizer's `zero_grad(set_to_none=True)`, or a
  replica compiled after `prepare`); an unsharded one takes such gradients back (usage.py), and
  refuses only one the script replaced after its bucket went out, naming it.
- `gradients_written`: the refusal when the script wrote into gradients between backward and
  their sum (`clip_grad_norm_` before `finish_gradient_sync()`; usage.py sees it by the buckets'
  version counters).
- `UnsyncedGradientGuard`: a backward whose gradients no exchange summed (a forgotten
  `finish_gradient_sync()`, silent with overlap=False) is refused at the optimizer's step, or at
  `zero_grad()` after an update by hand, or at a GradScaler's `unscale_` (unscale.py), naming the fix.

Every rank sees the same gathered data, so every rank raises the same error at the same point.
"""

from __future__ import annotations

import hashlib
import math
import weakref
from typing import Any, Collection, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from phalanx.comm import Tag, broadcast_, collective, gather_objects
from phalanx.data_parallel.guards.unscale import watch as watch_unscale
from phalanx.data_parallel.replica_hook import OptimizerVerdicts, steps_replica
from phalanx.errors import Misuse, RunFailed, UsageError
from phalanx.runtime.world import World


class ReplicaMismatch(RunFailed):
    """Ranks disagree on something that must be identical."""


class NonFinite(RunFailed, FloatingPointError):
    """The loss or a summed gradient is NaN or infinite."""


class GradientsDetached(UsageError, RuntimeError):
    """A parameter's .grad no longer aliases its gradient bucket (something set it to None)."""


def check_gradients_aliased(usage, module: torch.nn.Module, *, compiled_after_prepare: bool, sharded: bool) -> None:
    """At a sync whose gradients are not all their bucket slots (`usage`, usage.py, explains a
    gradient the script set to None after it landed): `gradients_detached` for the rest."""
    replaced = usage.unaliased() if usage is not None else None
    if usage is not None and replaced is None and not sharded:
        return
    name = next((n for n, p in module.named_parameters() if p is replaced), None) if replaced is not None else None
    raise gradients_detached(compiled_after_prepare=compiled_after_prepare, sharded=sharded, replaced=name)


def gradients_detached(*, compiled_after_prepare: bool, sharded: bool = False,
                       replaced: str | None = None) -> GradientsDetached:
    """The one-line refusal, naming the likely cause: a replica compiled after prepare, whose
    wrapper's zero_grad() is nn.Module's (it sets .grad to None), or optimizer.zero_grad() - on a
    sharded replica, of a torch optimizer built over dp.parameters() instead of by dp.optimizer;
    unsharded, a gradient the script replaced (`replaced`, its name) after its bucket was sent."""
    if sharded and not compiled_after_prepare:
        return GradientsDetached(
            "a parameter's .grad no longer aliases its gradient bucket: a torch optimizer built over dp.parameters() "
            "set it to None in its zero_grad(), and on a sharded replica it would also step every parameter with "
            "gradients summed only in this rank's range; build the optimizer with dp.optimizer(torch.optim.AdamW, "
            "lr=...) (any element-wise torch optimizer class, with its own arguments)")
    if compiled_after_prepare:
        return GradientsDetached(
            "a parameter's .grad no longer aliases its gradient bucket: the replica was compiled after prepare, and "
            "the compiled wrapper's zero_grad() is nn.Module's, which drops the buckets; compile the model before "
            "prepare: dp = phalanx.prepare(torch.compile(model), world=world)")
    if replaced is not None:
        return GradientsDetached(
            f"the gradient of {replaced} was replaced between backward and finish_gradient_sync() (p.grad = ...): the "
            "exchange summed the gradient backward left in its bucket, not the new tensor; change gradients after the "
            "sync, where p.grad is the sum (or set p.grad from torch.autograd.grad instead of calling backward)")
    return GradientsDetached("a parameter's .grad no longer aliases its gradient bucket; use DataParallel.zero_grad() "
                             "instead of optimizer.zero_grad(set_to_none=True)")


class GradientsWritten(UsageError, RuntimeError):
    """Unsummed gradients were written in place before the sync (a clip by each rank's own norm)."""


def gradients_written(params: Sequence[torch.nn.Parameter], module: torch.nn.Module) -> GradientsWritten:
    """The one-line refusal naming the first of `params`, whose gradients were written before their sum."""
    names = {id(param): name for name, param in module.named_parameters()}
    more = f" and {len(params) - 1} more" if len(params) > 1 else ""
    return GradientsWritten(
        f"the gradients of {names.get(id(params[0]), 'a parameter')}{more} were written in place between backward "
        "and finish_gradient_sync() (torch.nn.utils.clip_grad_norm_ before the sync?): each rank changed its own "
        "unsummed share, and a clip by each rank's own norm is not the clip of the sum; call "
        "dp.finish_gradient_sync() right after backward, then clip and step (a register_post_accumulate_grad_hook "
        "that writes p.grad: register it before prepare, so it writes each rank's share before it lands, as under "
        "DDP)")


def model_fingerprint(module: torch.nn.Module) -> str:
    """A short hash of parameter names, shapes and dtypes (not values)."""
    text = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in module.named_parameters())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def preflight_check(world: World, fields: dict[str, Any]) -> None:
    """All-gather `fields` (picklable, small) and raise if any rank's differ from rank 0's."""
    if not world.distributed:
        return
    gathered = gather_objects(world, fields, Tag("pre-flight check"))
    reference = gathered[0]
    for rank, theirs in enumerate(gathered):
        for field in sorted(set(reference) | set(theirs)):
            if reference.get(field) != theirs.get(field):
                raise ReplicaMismatch(
                    f"pre-flight check: rank {rank} differs from rank 0 in {field} "
                    f"({theirs.get(field)!r} vs {reference.get(field)!r}); every rank must run the same "
                    "model, settings and data")


def tensor_checksums(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per tensor: the float64 sum and an index-weighted sum (catches permutations)."""
    sums = []
    with torch.no_grad():
        for t in tensors:
            flat = t.detach().reshape(-1).double()
            weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
            sums += [flat.sum(), (flat * weights).sum()]
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.float64)


def check_replicas(world: World, module: torch.nn.Module, *, step: int | None, buffers_only: bool = False,
                   skip: Collection[str] = (), found: str | None = None) -> None:
    """Raise ReplicaMismatch naming the first parameter or buffer whose value on some rank differs
    from rank 0's at `step` (None: before an evaluation; `found`: the words instead, "found by close()").
    `buffers_only`: parameters are skipped (they stay identical by construction; buffers are what a
    forward can change per rank); `skip`: buffers left out by name (statistics legitimately per rank)."""
    if not world.distributed:
        return
    buffers = [(n, b) for n, b in module.named_buffers() if n not in skip]
    named = ([] if buffers_only else [(n, "") for n, _ in module.named_parameters()]) + \
        [(n, " (a buffer)") for n, _ in buffers]
    if not named:  # every rank holds the same model, so every rank returns here alike
        return
    tensors = ([] if buffers_only else list(module.parameters())) + [b for _, b in buffers]
    mine = tensor_checksums(tensors).to(world.device)
    gathered = [torch.empty_like(mine) for _ in range(world.world_size)]
    with collective(world, Tag("replica check"), size_bytes=mine.numel() * mine.element_size()):
        dist.all_gather(gathered, mine)
    when = f"({found})" if found else f"at step {step}" if step is not None else "before evaluation"
    for rank, theirs in enumerate(gathered):
        # Bit patterns, not values: a NaN checksum on every rank alike is not a divergence (the
        # NaN/Inf check names it), and NaN != NaN would call a rank different from itself.
        differs = (theirs.view(torch.int64) != gathered[0].view(torch.int64)).nonzero().flatten().tolist()
        if differs:
            name, kind = named[differs[0] // 2]
            far = f" by up to {_distance(world, tensors[differs[0] // 2], rank):.3g}" if kind else ""
            cause = (_buffer_cause(module, name) if kind else
                     "the ranks no longer apply identical updates (a rank-dependent code path or reduction?)")
            raise ReplicaMismatch(f"replicas diverged {when}: rank {rank}'s {name}{kind} differs from rank 0's{far}; "
                                  f"{cause}")


def _distance(world: World, tensor: torch.Tensor, rank: int) -> float:
    """The largest difference between rank 0's `tensor` and rank `rank`'s, the same on every rank
    (both broadcast: a collective, on the error's path only)."""
    pair = [broadcast_(tensor.detach().clone(), world=world, src=src, tag=Tag("replica check")) for src in (0, rank)]
    return (pair[0].double() - pair[1].double()).abs().max().item() if tensor.numel() else 0.0


def _buffer_cause(module: torch.nn.Module, name: str) -> str:
    """Why buffer `name` differs, and what to do: a norm layer's statistics have phalanx's two
    remedies; any other buffer a forward updates (a running normalizer of one's own, an EMA
    codebook) is the script's to keep equal."""
    owner, path = None, name.rpartition(".")[0]
    for root in (module, getattr(module, "module", None)):  # a DataParallel names its module's buffers unprefixed
        try:
            owner = root.get_submodule(path) if path else root
            break
        except (AttributeError, TypeError):
            continue
    if isinstance(owner, torch.nn.modules.batchnorm._NormBase):
        return ("a norm layer's statistics, which the forward updates from each rank's own data; keep DataParallel's "
                "average_running_stats=True, or use batchnorm=\"sync\"")
    return ("a buffer the forward updates from each rank's own data, which phalanx leaves alone (it averages "
            "BatchNorm/InstanceNorm statistics only; DDP broadcasts rank 0's); update it from values reduced over "
            "the ranks (phalanx.allreduce or phalanx.reduce the statistics, e.g. an EMA codebook's counts and sums, "
            "before the update), or average it after each step (phalanx.allreduce(buffer, world=world), then divide "
            "by world.world_size), or broadcast rank 0's (dp.broadcast_state())")


def check_finite(*, loss: torch.Tensor | None, buffers: Sequence[torch.Tensor] | Mapping[str, torch.Tensor], step: int,
                 rank: int) -> None:
    """Raise NonFinite (a FloatingPointError) naming the step and rank when the loss or a gradient is NaN/Inf.

    `buffers`: the gradient buckets (named "gradient bucket i"), or gradients by name
    (`DataParallel.named_gradients()`). Each check reads a value on the host: on a GPU, call it
    only at the steps that check (it synchronises).
    """
    # A loss is one number: read it (no kernel; on the CPU, checked every step, that is what it costs).
    if loss is not None and not all(math.isfinite(v) for v in loss.detach().reshape(-1).tolist()):
        raise NonFinite(f"loss is {loss.item()} at step {step} on rank {rank}; lower --lr or check the data")
    named = (buffers.items() if isinstance(buffers, Mapping)
             else ((f"gradient bucket {i}", b) for i, b in enumerate(buffers)))
    for name, buffer in named:
        if not bool(torch.isfinite(buffer).all()):
            raise NonFinite(f"{name} holds NaN/Inf at step {step} on rank {rank}; lower --lr or check the data")


class UnsyncedGradientGuard:
    """Refuses to use gradients of a synced backward that were never exchanged.

    Its owner calls `landed()` as a backward lands gradients, and clears `pending` (sync on) and
    `accumulating` (under no_sync()) once they are summed. A step pre-hook on every optimizer that
    steps the module raises while either is set, naming the fix: a step inside no_sync() (an
    Accelerate `accumulate` block ported as it is, whose optimizer skips such steps) reads each
    rank's own accumulated gradient. `take_unread()` (from zero_grad) raises too if the parameters were written
    since the gradients landed (an update by hand read them unsummed); if nothing wrote them, the
    gradients were never used - a backward through this replica for another model's loss, as a
    GAN's generator step runs through its discriminator or an actor's through its critic - and
    zero_grad zeroes them, as on one device: unsummed where nothing went out yet (every rank
    skips the exchange alike; DDP pays it), summed first where overlap put buckets on the wire
    during that backward. "Written" is
    the parameters' version counters, noted once per step at the first landing (about 0.06 us a
    tensor); an update through `.data` bypasses them. The hook is process-wide (torch has no per-module one) but costs a
    flag test while nothing is pending; it holds the guard weakly, so a dropped replica is not
    kept alive, and `close()` removes it."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.pending = False
        self.accumulating = False  # a backward under no_sync() landed this rank's own, unsummed gradients
        self._module = module
        self._params = list(module.parameters())
        self._versions: list[int] = []  # the parameters' version counters when `pending` was set
        self._verdicts = OptimizerVerdicts()  # does it hold the module's parameters? (held weakly: no id reused)
        self._handle = register_optimizer_step_pre_hook(_step_hook(weakref.ref(self)))
        watch_unscale(self)  # a GradScaler's unscale_ before the sum is refused too (unscale.py)

    def landed(self, *, synced: bool) -> None:
        """A gradient landed: with sync on, the step's gradients are pending (noted once); under
        no_sync() they accumulate unsummed, which a step must not read."""
        if not synced:
            self.accumulating = True
        elif not self.pending:
            self.pending = True
            self._versions = [p._version for p in self._params]

    @property
    def unsummed(self) -> bool:
        """Whether a backward's gradients wait unsummed (synced, or accumulated under no_sync()): no step may read them."""
        return self.pending or self.accumulating

    def written_since_marked(self) -> bool:
        return self.pending and [p._version for p in self._params] != self._versions

    def check(self, what: str) -> None:
        if self.pending:
            raise Misuse(f"{what} after a backward whose gradients were never summed across ranks: call "
                         "dp.finish_gradient_sync() between loss.backward() and optimizer.step(), or the "
                         "replicas drift apart")

    def take_unread(self, what: str) -> bool:
        """At zero_grad: raise if an update wrote the parameters since unsummed gradients landed;
        else forget them, returning whether there were any (see the class docstring)."""
        if self.written_since_marked():
            self.check(what)
        pending, self.pending, self.accumulating = self.pending, False, False
        return pending

    def steps_module(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether `optimizer` holds any of the module's parameters (judged again when its groups change)."""
        return self._verdicts.of(optimizer, lambda judged: steps_replica(judged, self._module, None))

    def check_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.steps_module(optimizer):
            return
        self.check("optimizer.step()")
        if self.accumulating:  # Accelerate's optimizer skips a step inside accumulate(); torch's does not
            raise Misuse("optimizer.step() on gradients accumulated with the sync off (inside dp.no_sync(), "
                         "after dp.require_backward_grad_sync = False, or before dp.accumulate()'s last "
                         "micro-batch) and never summed across ranks: each rank would step on its own and the "
                         "replicas drift apart; step once per step, after dp.finish_gradient_sync() (nanoGPT's "
                         "loop: dp.require_backward_grad_sync = True before the last micro-batch's backward; in "
                         "dp.accumulate(n): after the last micro-batch, when dp.sync_enabled is True)")

    def close(self) -> None:
        self._handle.remove()


def _step_hook(guard: "weakref.ref[UnsyncedGradientGuard]"):
    def hook(optimizer, args, kwargs) -> None:
        target = guard()
        if target is not None and target.unsummed:
            target.check_step(optimizer)

    return hook
