"""The `nn.Module` face of a data-parallel replica: what lets `DataParallel` stand where the model stood.

Code written for torch DDP, or for the plain model, calls `.train()`, `.eval()`, `.parameters()`,
`.state_dict()`, `.to()` and `model(x)` on the wrapper; without them a ported script needs `.module` wherever it
touches the model. `ReplicaModule` gives them, over the wrapped model held as the submodule `module` (DDP's
name, so `dp.module` keeps working), broadcast from rank 0 at construction (`broadcast_state_`). One deliberate
difference from DDP: names carry no `module.` prefix - `dp.state_dict()` and `dp.named_parameters()` are the
model's own, so `torch.save(dp.state_dict())` loads into the plain model, and a checkpoint does not depend on
how many devices wrote it; they resolve on the replica too (`dp.get_parameter("0.weight")`, and DCP's
`get_state_dict(dp, optimizer)` walking them). `load_state_dict` takes the model's keys, or DDP's prefixed ones. What leaves it -
`state_dict()`, `full_state_dict()`, `check_finite()` - first checks the gradients of the steps since the last
NaN/Inf check (guards/finite.py), so nothing non-finite is saved.

Refused, because the gradients live as views in the exchange's buckets: moving, casting or re-laying-out the
parameters once the buckets exist (one that changes nothing is a no-op), and `load_state_dict(assign=True)`; and a
model unfit to be a replica (unfit.py, checked by `placed`). `forward` may run under `torch.autocast`
(`precision="bf16-mixed"`, as Fabric and Accelerate do): weights, gradients and exchange stay float32, and
floating outputs come back float32 in their own containers (a Hugging Face `ModelOutput` is still read as
`out.logits`). While `capturing()`, a CUDA graph records a one-device step. The first forward under `auto`'s
channels_last is a trial (format_fallback.py). DDP's own face carries over: `require_backward_grad_sync` (nanoGPT
sets it per micro-batch) is `no_sync()`'s switch; DDP's methods phalanx has no use for (`join`, ...) are an
AttributeError naming phalanx's way; a forward failing on its inputs' dtype or a whole batch, one line (whole_batch.py).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn
from torch._C import DisableTorchFunctionSubclass

from phalanx.comm import ALLREDUCE, Tag, broadcast_
from phalanx.data_parallel.ddp_keys import without_ddp_prefix
from phalanx.data_parallel.guards.finite import FiniteCheck
from phalanx.data_parallel.guards.replicas import ReplicaCheck
from phalanx.data_parallel.input_dtype import input_dtype_mismatch
from phalanx.data_parallel.sharding.gathered import gathered_parameters
from phalanx.data_parallel.unfit import refuse_unfit
from phalanx.data_parallel.whole_batch import whole_batch_passed
from phalanx.data_parallel.widen import widened
from phalanx.errors import Misuse, UsageError
from phalanx.runtime.foreign_names import REPLICA_NAMES, replica_name_error
from phalanx.runtime.world import World

# deepcopy/AveragedModel/torch.save of dp: a copy would share or lose this rank's buckets, hooks and exchange.
NOT_COPIED = ("a DataParallel replica cannot be copied or pickled: it holds this rank's gradient buckets and "
              "communication; copy or save the model inside it, e.g. AveragedModel(dp.module), "
              "copy.deepcopy(dp.module) (under shard=\"parameters\", inside `with dp.gathered_parameters():`), "
              "torch.save(dp.state_dict())")
# torch.distributed.checkpoint's get_state_dict/set_state_dict on a sharded replica.
DCP_SHARDED = ("torch.distributed.checkpoint's state-dict functions read whole parameters and a torch optimizer's "
               "state per parameter, which a replica under shard=\"{shard}\" does not hold (each rank steps flat "
               "pieces of them): save with phalanx.checkpoint(...) and resume with phalanx.resume(...), exact on any "
               "device count and stage, or use them on a replica with shard=\"none\"")


class ReplicaModule(nn.Module):
    """Base of DataParallel: the model as submodule `module`, its names unprefixed (see above)."""

    module: nn.Module
    exchanging: bool  # True once gradient buckets hold the parameters' .grad
    sharding: Any = None  # sharding/stages.py's Sharding under shard=..., else None
    autocast: tuple[str, torch.dtype] | None  # (device type, dtype) for forward, or None
    _finite: FiniteCheck  # the gradient's NaN/Inf watch, checked before state leaves (guards/finite.py)
    _replicas: ReplicaCheck  # the comparison with the other ranks' replicas (guards/replicas.py)
    _format: Any  # format_fallback.py's FormatFallback: the first forward under auto's channels_last
    _synced_steps: int  # synced steps so far
    _closed: bool
    _capturing: bool  # a CUDA graph is recording the step (capturing())
    _sync_enabled: bool  # False inside no_sync(): backward's gradients accumulate locally
    exchange_in_flight: bool  # a bucket was launched and finish_gradient_sync() has not returned
    buckets: list  # the gradient buckets (buckets.py), empty with nothing to exchange
    world: World
    _scheduler: Any = None  # overlap.py's OverlapScheduler while exchanging, else None
    _usage: Any = None  # usage.py's ParameterUsage while exchanging, else None
    # torch.compile(dp): its wrapper's zero_grad() (nn.Module's) sets .grad to None; back into the buckets at the next
    # landing (usage.py), but on a sharded replica, whose refusal names this (noted here, where the compiler traces).
    compiled_after_prepare = False

    def __deepcopy__(self, memo: dict) -> Any:
        raise TypeError(NOT_COPIED)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(NOT_COPIED)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # parameters, buffers and submodules (`module`)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is not None and (name in inner._modules or name in inner._parameters or name in inner._buffers):
                return getattr(inner, name)  # dp's names are the model's: they resolve here too
            if name in REPLICA_NAMES:  # DDP's method, DeepSpeed engine's: phalanx's way in one line
                raise replica_name_error(type(self).__name__, name) from None
            if inner is not None and not name.startswith("__") and hasattr(inner, name):  # nanoGPT's generate
                raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'; the model's own "
                                     f"attributes live on the wrapped model: dp.module.{name} (as DDP's "
                                     "model.module)") from None
            raise

    def _fqn_modifiers(self) -> dict[str, str]:
        # torch.distributed.checkpoint's contract (torch >= 2.7) for a module whose state_dict keys leave
        # out an attribute: each first name of the keys maps to `module`, the one they skip, so
        # get_state_dict(dp, optimizer) names model and optimizer state as the plain model's are named.
        if self.sharding is not None:  # its state-dict functions ended in KeyError: 0 inside torch
            raise UsageError(DCP_SHARDED.format(shard=self.sharding.stage))
        return dict.fromkeys(_first_names(self.module), "module")

    def broadcast_state(self, *, src: int = 0) -> None:
        """Make every replica equal to rank `src`'s parameters and buffers (one flat broadcast)."""
        broadcast_state_(self.module, world=self.world, src=src)

    @property
    def sync_enabled(self) -> bool:
        """False inside `no_sync()` (or after `require_backward_grad_sync = False`)."""
        return self._sync_enabled

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's switch, as nanoGPT sets it per micro-batch: False accumulates the next backwards'
        gradients locally, as inside `no_sync()`; True exchanges the next synced backward's sum."""
        return self._sync_enabled

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, sync: bool) -> None:
        if not sync and self.exchange_in_flight:
            raise Misuse("require_backward_grad_sync = False set while gradient allreduces are in flight; "
                         "call finish_gradient_sync() first")
        self._sync_enabled = bool(sync)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            if not self.compiled_after_prepare:
                self.compiled_after_prepare = True
            return self._forward(*args, **kwargs)
        if self._scheduler is not None and self._scheduler.started and self.sharding is None:
            # Another backward of this step follows a forward (DCGAN's D on real, then on fake): what has landed
            # is summed now and set aside (overlap.py's settle), so its gradients land in buckets off the wire.
            self._scheduler.settle()
            self._finite.another_backward()
            if self._usage is not None:
                self._usage.noted()  # the zeroed buckets, written by the replica itself
        if self._layout is not None:
            self._layout.before_forward((*args, *kwargs.values()))  # examples noted; a sum carried without zero_grad kept once (carry.py)
        try:
            return self._format.forward(self._forward, *args, **kwargs)  # auto's channels_last tried (format_fallback.py)
        except (RuntimeError, TypeError, AttributeError) as exc:  # one line each: input_dtype.py, whole_batch.py
            named = input_dtype_mismatch(exc, (*args, *kwargs.values()), self.module, self.autocast)
            if (named := named or whole_batch_passed(exc, args)) is None:
                raise
            raise named from exc

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.autocast is None:
            return self.module(*args, **kwargs)
        device_type, dtype = self.autocast
        # A CUDA graph recording the step must not keep autocast's cast weights across steps.
        cache = not getattr(self, "_capturing", False)
        with torch.autocast(device_type=device_type, dtype=dtype, cache_enabled=cache):
            out = self.module(*args, **kwargs)
        return widened(out)

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """While a CUDA graph records a step of a replica with nothing to exchange: not a step, so finish_gradient_sync
        counts nothing and reads nothing on the host (its NaN/Inf check); call it after each replay."""
        if self.exchanging:
            raise Misuse("capturing a replica that exchanges gradients is not supported; "
                         "capture a one-device replica's step")
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False

    def held_weights(self) -> list[torch.Tensor]:
        """This rank's weights: the parameters or (shard="parameters") its shards, as the NaN/Inf check reads them."""
        if self.sharding is not None and not self.sharding.keeps_parameters:
            return list(self.sharding.params.shard)
        return list(self.module.parameters())

    def named_gradients(self) -> dict[str, torch.Tensor]:
        """What the finite-gradient guard reads, by a name for its line: each bucket, or each parameter's gradient."""
        if self.sharding is not None:
            return self.sharding.named_gradients()
        if self.exchanging:
            return {f"gradient bucket {bucket.index}": bucket.buffer for bucket in self.buckets}
        return {f"{name}'s gradient": param.grad for name, param in self.module.named_parameters()
                if param.grad is not None}

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The model's own state dict: no `module.` prefix (load it into the plain model). First this rank's own
        NaN/Inf notes since the last check (guards/finite.py's check_local: no collective, so rank 0 may call it
        alone; a sharded replica's notes hold only its share of the sum, so its parameters are read too)."""
        if not self._closed:
            whole = self.sharding is not None and self.sharding.keeps_parameters
            self._finite.check_local(step=self._synced_steps, where="state_dict()",
                                     gradients=None if self.exchanging else self.named_gradients,
                                     parameters=self.module.named_parameters if whole else None)
        return self.module.state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)

    def check_finite(self, *, where: str = "dp.check_finite()") -> None:
        """Check the gradients of the synced steps since the last NaN/Inf check now; every rank
        calls it (a collective, where steps are pending). NonFinite names the first step and rank."""
        if self._closed:
            return
        found = self._finite.found_by(where, self._synced_steps)
        if not self.exchanging:
            return self._finite.after_local_step(self.named_gradients, step=self._synced_steps, found=found)
        self._finite.check_now(step=self._synced_steps, allreduce=self._finite_check_sum, found=found)

    def check_replicas(self, *, where: str = "dp.check_replicas()", optimizers=()) -> None:
        """Compare the replicas' parameters and their optimizers' settings and state (those seen stepping it,
        and `optimizers`) now, a collective: every rank calls it. ReplicaMismatch names the ranks that differ."""
        if self.world.distributed and not torch.distributed.is_initialized():  # nanoGPT's ending, then close()
            raise UsageError(f"{'dp.' if where == 'close()' else ''}{where} compares the replicas over the process "
                             "group, which torch.distributed.destroy_process_group() already tore down: call dp.close() before it")
        if not self._closed:
            self._replicas.check(step=self._synced_steps, optimizers=optimizers,
                                 found=f"found by {where} after step {self._synced_steps}")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict, detached copies: under shard="parameters" its
        parameters gathered bucket by bucket (a collective: call it on every rank), after the NaN/Inf
        check of the steps since the last one (NonFinite names the step and rank)."""
        self.check_finite(where="full_state_dict()")  # DataParallel's: nothing non-finite leaves
        if self.sharding is None:
            return {k: v.detach().clone() for k, v in self.state_dict().items()}
        with self.sharding.whole():
            return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """Copy `state_dict` into the model: its own keys, or DDP's `module.`-prefixed ones.
        Every rank should load the same values (or call `broadcast_state()` afterwards). Under
        shard="parameters" each rank copies its range of each parameter (no collective)."""
        if assign and self.exchanging:
            raise ValueError("load_state_dict(assign=True) would replace the parameters whose gradients live in "
                             "DataParallel's buckets; load with assign=False (copies the values in)")
        state = without_ddp_prefix(state_dict, self.module)
        if self.sharding is None or self.sharding.keeps_parameters:
            return self.module.load_state_dict(state, strict=strict, assign=assign)
        return self.sharding.load_state_dict(self.module, state, strict=strict)

    def gathered_parameters(self, *, writeback: bool = False):
        """A block in which `dp.module`'s parameters are whole on every rank, which all enter it (a no-op
        but under shard="parameters"); `writeback=True` keeps an edit made alike on every rank (sharding/gathered.py)."""
        tag = Tag("parameters", step=self._synced_steps)  # beside the block's gathers
        return gathered_parameters(self.sharding, writeback=writeback, rank=self.world.rank,
                                   world_size=self.world.world_size, allreduce=lambda f: self.allreduce_now(f, tag))

    def close(self) -> None:  # DataParallel's: its hooks, its communication
        raise NotImplementedError

    def allreduce_now(self, flat: torch.Tensor, tag: Tag = ALLREDUCE) -> None:
        """`flat` summed in place on every rank now, on this thread, through this replica's exchange (DataParallel's)."""
        raise NotImplementedError

    def _finite_check_sum(self, flat: torch.Tensor) -> None:
        """The NaN/Inf check's sum, tagged so that a peer in another collective names it."""
        self.allreduce_now(flat, tag=Tag("NaN/Inf check", step=self._synced_steps))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        if not recurse:  # the wrapper holds no parameters of its own
            return iter(())
        return self.module.named_parameters(prefix=prefix, recurse=True, remove_duplicate=remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        if not recurse:
            return iter(())
        return self.module.named_buffers(prefix=prefix, recurse=True, remove_duplicate=remove_duplicate)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True):
        # Every `.to()`, `.cuda()`, `.double()`, `.half()` ... arrives here. A conversion that
        # changes nothing returns the tensor itself; anything else would rebind .grad away from
        # its bucket, so it is refused before a single parameter is touched.
        with DisableTorchFunctionSubclass():  # a stage-3 parameter at rest (at_rest.py) converts as it is
            moved = self.exchanging and next((n for n, p in self.module.named_parameters() if fn(p) is not p), None)
            if moved:
                raise ValueError(
                    f"moving, casting or re-laying-out the replica's parameters ({moved} first) after "
                    "DataParallel built its gradient buckets would detach them from the exchange; convert the "
                    "model before wrapping it (phalanx.prepare(model, world=world, dtype=..., memory_format=...) "
                    "also puts it on world.device)")
            return super()._apply(fn, recurse)


def _first_names(module: nn.Module) -> set[str]:
    """The first names of `module`'s state: its own parameters, buffers and children."""
    return {*module._parameters, *module._buffers, *module._modules}


def placed(module: nn.Module, device: torch.device, *, world_size: int = 1) -> nn.Module:
    """`module` moved to `device`, once `refuse_unfit` found nothing to refuse (a meta module
    cannot even move): a replica's first step, before `broadcast_state_`."""
    refuse_unfit(module, world_size=world_size)
    return module.to(device)


@torch.no_grad()
def broadcast_state_(module: nn.Module, *, world: World, src: int = 0) -> None:
    """Make every replica equal to rank `src`'s parameters and buffers (one flat broadcast per dtype)."""
    if not world.distributed:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in list(module.parameters()) + list(module.buffers()):
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for group in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        broadcast_(flat, world=world, src=src)
        torch._foreach_copy_(group, [piece.view_as(t) for piece, t in zip(torch.split(flat, [t.numel() for t in group]), group)])
