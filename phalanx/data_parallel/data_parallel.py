"""Data parallelism as in D2L 13.5: every rank holds a full replica and sums gradients.

`DataParallel` owns the replica's synchronisation contract, the one torch DDP established: rank 0's parameters
and buffers are broadcast at construction so replicas start identical; gradients live in flat buckets
(buckets.py) summed across ranks with the chosen allreduce; `no_sync()` skips the exchange for gradient
accumulation. Averaging is the caller's loss scale (sum over the shard / global batch size), which keeps the
update exactly the 1-device update even when the last batch splits unevenly across ranks. `shard` keeps only
this rank's share of the optimizer state, gradients or parameters (ZeRO; sharding/): each bucket's allreduce
becomes a reduce-scatter, and the optimizer comes from `dp.optimizer(cls, ...)`.

One send path, two schedules, the same result: every bucket goes out through `_launch` (wire dtype, trace, tag)
and is waited once in `finish_gradient_sync()` (overlap.py's scheduler). With overlap a gradient hook launches
each bucket the moment its last gradient lands, so its exchange runs (on the comm's thread) while backward
computes the earlier layers; without it `finish_gradient_sync()` runs every bucket's exchange on the calling
thread, then returns. `overlap=None` (the default) chooses per host (config.py's `resolve_overlap`). Either way
the caller's step is: zero_grad, forward, backward, finish_gradient_sync, optimizer step. Each bucket's exchange
is tagged `Tag("gradient", i, step=s)`, so a rank that meets another collective is named at once
(comm/watchdog.py); a synced backward never exchanged is refused at an optimizer step or update that reads it,
and zeroed by zero_grad() if none did (guards/checks.py). Every `check_finite_every` synced steps the gradient
is checked for NaN/Inf (guards/finite.py) and the replicas compared (guards/replicas.py; also at the first
step), both again before state leaves the replica (`check_finite`, `check_replicas`: phalanx.checkpoint, close).

Its options are one `DataParallelConfig` (config.py), checked where made. A world of one builds nothing (no
buckets, hooks, thread or collectives: the plain loop's step); `exchange_alone` builds the exchange on one device
too, and `DataParallel.over(comm, ...)` exchanges over the caller's comm (one that counts bytes). A `DataParallel`
is an `nn.Module` (replica.py); DDP users' habits are made right or named after each synced exchange
(guards/step_extras.py). `dp.choices` says what it runs with; its SyncBatchNorm layers sum through its exchange.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterable, Iterator

import torch
from torch import nn

from phalanx.comm import ALLREDUCE, AsyncComm, Tag, open_comm, resolve_algorithm
from phalanx.data_parallel.accumulate import accumulate, no_sync
from phalanx.data_parallel.buckets import Bucket, DecompressingHandle, grads_are_bucket_views, wire_of
from phalanx.data_parallel.choices import replica_choices
from phalanx.data_parallel.config import DataParallelConfig, bucket_cap_for, resolve_overlap
from phalanx.data_parallel.format_fallback import FormatFallback
from phalanx.data_parallel.guards.checks import UnsyncedGradientGuard, check_gradients_aliased, gradients_written
from phalanx.data_parallel.guards.closure import ClosureLoss
from phalanx.data_parallel.guards.finite import FiniteCheck
from phalanx.data_parallel.guards.replicas import ReplicaCheck
from phalanx.data_parallel.guards.step_extras import StepExtras
from phalanx.data_parallel.layout import AddedParameters, BucketLayout
from phalanx.data_parallel.overlap import OverlapScheduler, landing_hooks, unhooked
from phalanx.data_parallel.replica import ReplicaModule, broadcast_state_, placed
from phalanx.data_parallel.sharding.optim import make_optimizer
from phalanx.data_parallel.sharding.stages import MAX_IN_FLIGHT, Sharding
from phalanx.data_parallel.unfit import RefusesAnOuterWrapper, held
from phalanx.data_parallel.sync_batchnorm import route_sync_batchnorm
from phalanx.errors import Misuse
from phalanx.runtime.world import World
from phalanx.telemetry import Tracer

__all__ = ["DataParallel"]


class DataParallel(ReplicaModule, RefusesAnOuterWrapper):
    """A replica plus its gradient exchange, as an nn.Module. Construct it at the same point on
    every rank (the broadcast and AsyncComm's group or segment are collectives)."""

    def __init__(self, module: nn.Module, *, world: World, options: DataParallelConfig | None = None,
                 tracer: Tracer | None = None) -> None:
        """`module` as a replica on `world.device`, exchanging as `options` say (a DataParallelConfig,
        config.py, whose fields say what each does; None: its defaults). Under `shard`, build the optimizer
        with `dp.optimizer(cls, ...)`. `tracer`: a Tracer each bucket's exchange is reported to (None: off)."""
        super().__init__()  # nn.Module's bookkeeping first: every attribute below goes through it
        self._build(module, world=world, options=options or DataParallelConfig(), tracer=tracer, comm=None)

    @classmethod
    def over(cls, comm: AsyncComm, module: nn.Module, *, world: World, options: DataParallelConfig | None = None,
             tracer: Tracer | None = None) -> DataParallel:
        """A replica whose buckets go out over `comm`, an AsyncComm or any object with its methods (a transport
        that counts the bytes): the caller's, who closes it after `close()`; it exchanges even in a world of one."""
        replica = cls.__new__(cls)
        ReplicaModule.__init__(replica)
        replica._build(module, world=world, options=options or DataParallelConfig(), tracer=tracer, comm=comm)
        return replica

    def _build(self, module: nn.Module, *, world: World, options: DataParallelConfig, tracer: Tracer | None,
               comm: AsyncComm | None) -> None:
        world.check_here("phalanx.prepare (DataParallel)")
        self.options, self.world, self.exchanging, self.average = options, world, False, options.average
        self._finite = FiniteCheck(every=options.check_finite_every, world=world, weights=self.held_weights)
        self.autocast = None if options.forward_dtype is None else (world.device.type, options.forward_dtype)
        # Refuses an algorithm that cannot carry this world's tensors before the module moves.
        self.algorithm = resolve_algorithm(options.allreduce, world)
        self.fallback_reason: str | None = None  # why auto did not get shm where it usually would
        self.grad_dtype, self.tracer = options.wire_dtype, tracer
        # Whether buckets go out beside backward, and what auto saw (config.py's resolve_overlap).
        self.overlap, self.overlap_reason = resolve_overlap(options.overlap, algorithm=self.algorithm,
                                                            local_workers=world.local_world_size)
        self.module = placed(module, world.device, world_size=world.world_size)
        broadcast_state_(self.module, world=world, src=0)
        # False: a world of one with nothing to exchange (see the module docstring).
        self.exchanging = world.distributed or options.exchange_alone or comm is not None
        self._owns_comm = comm is None and self.exchanging  # first: a fallback to native changes the buckets' cap
        if self._owns_comm:  # it owns the shm segment or the private group
            comm, self.algorithm, self.fallback_reason = open_comm(world, options.allreduce, threaded=self.overlap)
        self._comm: AsyncComm | None = comm
        # The buckets for the parameters that train now (layout.py), and what each step used (usage.py).
        self._layout = BucketLayout(self.module, shard=options.shard, first_bucket_cap_mb=options.first_bucket_cap_mb,
                                    bucket_cap_mb=bucket_cap_for(options.bucket_cap_mb, algorithm=self.algorithm),
                                    world=world, average=options.average) if self.exchanging else None
        self.buckets: list[Bucket] = self._layout.buckets if self.exchanging else []
        self._sync_enabled, self._closed, self._capturing, self._synced_steps = True, False, False, 0  # (replica.py)
        self._extras = StepExtras(self.module, world=world, average=options.average, batchnorm=options.batchnorm,
                                  average_running_stats=options.average_running_stats)
        # How the shared segment sums, when one does: "compiled" or "Python (why)" (comm/shm_kernel.py).
        self.shm_rounds = getattr(comm, "shm_rounds", None) if self.algorithm in ("shm", "hierarchical") else None
        self._routes_bn = self.algorithm != "native" and route_sync_batchnorm(self.module, comm, self.algorithm) > 0
        self.shard = options.shard if self.exchanging else "none"  # one device: nothing to shard
        self._format = FormatFallback(self.module, requested=options.memory_format, can_fall_back=self.shard == "none",
                                      exchanging=self.exchanging, relayout=self._relayout)
        # Chosen before sharding empties stage 3's parameters (their layout names the memory format).
        self.choices = replica_choices(self, options)
        self.sharding = Sharding(stage=self.shard, module=self.module, buckets=self.buckets, rank=world.rank,
                                 world_size=world.world_size, comm=comm, algorithm=self.algorithm,
                                 steps=lambda: self._synced_steps) if self.shard != "none" else None
        if self.sharding is not None:  # a sum carried without zero_grad kept once; who divides it (average=True)
            self._extras.divide_by = self.sharding.adopt(self._layout.carry, divide_by=self._extras.divide_by)
        # Unsummed gradients refused at zero_grad / step; optimizer.step(closure) sees the global loss (guards/closure.py).
        self._unsynced = UnsyncedGradientGuard(self.module) if self.exchanging else None
        self._closures = ClosureLoss(world=world, average=options.average, module=self.module, sharding=self.sharding,
                                     unsynced=self._unsynced, allreduce=self.allreduce_now) if world.distributed else None
        self._replicas = ReplicaCheck(every=options.check_finite_every if self.exchanging else 0, world=world,
                                      module=self.module, sharding=self.sharding, allreduce=self.allreduce_now, owner=self)
        self._wire_buckets()
        # What zero_grad clears with nothing to exchange: the parameters, listed once (walking the modules every
        # step cost LeNet ~40 us); one added since is refused as at k ranks (1 device: its .grad never cleared).
        self._params = AddedParameters(self.module)
        held(self)  # built: a second prepare of these parameters is refused while this is open (unfit.py)

    def _wire_buckets(self) -> None:
        """The scheduler, the usage flags (usage.py) and the landing hooks of the buckets as laid
        out now: every parameter hooked to overlap or to note what it used."""
        window = None if self.sharding is None or self.sharding.keeps_gradients else MAX_IN_FLIGHT
        self._scheduler = OverlapScheduler(self.buckets, launch=self._launch, max_in_flight=window,
                                           module=self.module) if self.exchanging else None
        self._usage = self._layout.usage if self._layout is not None else None
        self._hook_handles = landing_hooks(self.buckets, self._on_grad_ready if self.overlap else self._on_backward,
                                           every_parameter=self.overlap)
        if self._usage is not None and not self.overlap:  # usage.landed itself: one Python frame (~1 us) per gradient
            self._hook_handles += landing_hooks(self.buckets, self._usage.landed, every_parameter=True)
        self._hook_handles += self._layout.sparse_hooks() if self._layout is not None else []  # (sparse.py)

    def _rewire(self) -> None:
        """The layout changed with `requires_grad` (layout.py): its new buckets take the hooks."""
        unhooked(self._hook_handles)
        self.buckets = self._layout.buckets
        self._wire_buckets()
        self.choices = replica_choices(self, self.options)

    def _relayout(self) -> None:
        """The parameters' strides changed (format_fallback.py): their buckets laid out again, the choices said again."""
        if self._layout is not None:
            self._layout.again(in_step=False)
            self._rewire()
        self.choices = replica_choices(self, self.options)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the bucket buffers (the views survive, and with `set_to_none` count as None until they land,
        and a None stays None: usage.py); with nothing to exchange, set every .grad to None (or zero it) as torch does."""
        if not self.exchanging:
            for param in self._params.checked():
                param.grad = None if set_to_none or param.grad is None else param.grad.detach_().zero_()
            return
        # Unsummed gradients no update read (a GAN's D under G's loss) are zeroed unsummed where nothing
        # went out (every rank skips alike); with overlap buckets may be on the wire: summed first. Read: refused.
        if self._unsynced.take_unread("zero_grad()") and not self._closed and self.overlap:
            self.finish_gradient_sync()
        if self._scheduler is not None:  # None once closed
            self._scheduler.reset()  # drop gradients marked by a backward that never finished
        if self._layout.before_step(set_to_none=set_to_none):  # requires_grad changed since the layout
            self._rewire()
        if self.sharding is not None and not self.sharding.keeps_gradients:
            return self.sharding.zero_grad()  # its buckets hold nothing between steps
        self._layout.zero()

    def no_sync(self, enabled: bool = True) -> contextlib.AbstractContextManager:
        """Accumulate gradients locally (`enabled=False`, Fabric's switch: sync as usual), restored even on error
        (accumulate.py). With overlap nothing launches inside; the next synced backward sends the sum (as DDP's)."""
        return no_sync(self, enabled=enabled)

    def accumulate(self, micro_batches: int | Iterable) -> Iterator:
        """Gradient accumulation as a loop: `micro_batches`' items (n: 0..n-1), all but the last under `no_sync()`."""
        return accumulate(self.no_sync, micro_batches)

    @property
    def first_step_pending(self) -> bool:
        """True until rank 0's first-step look (step_extras.py) ends; only meanwhile must losses use `shard_loss`."""
        return self._extras.first_step is not None

    @property
    def exchange_in_flight(self) -> bool:
        """True from a bucket's launch during backward until finish_gradient_sync() returns."""
        return self._scheduler is not None and self._scheduler.in_flight

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if self._usage is not None:
            self._usage.landed(param)
        self._unsynced.landed(synced=self._sync_enabled)
        if self._sync_enabled:
            self._scheduler.mark_ready(param)

    def _on_backward(self, param: nn.Parameter) -> None:
        self._unsynced.landed(synced=self._sync_enabled)

    def _launch(self, bucket: Bucket):
        """The one send path: `bucket`'s allreduce (sharded: its reduce-scatter), in its wire dtype, traced, tagged."""
        # Sharded stages 2-3 send the gradients autograd made (fill): in the bucket, or as they are.
        # An alias with a version counter of its own: the sum moves no counter the usage notes watch (usage.py).
        sent = bucket.storage.data if self.sharding is None else self.sharding.fill(bucket)
        if self._usage is not None and self._usage.rides:
            if bucket is self.buckets[-1]:
                self._usage.write_flags()  # every gradient of this rank's has landed by now (usage.py)
            self._usage.noted(bucket.index)
        wire = wire_of(sent, self.grad_dtype)  # then this rank's own sum, noted before the sum spreads it
        notes = self._finite.before_sum(sent, index=bucket.index, buckets=len(self.buckets), by_transport=(
            self._owns_comm and self.world.distributed and self.algorithm == "shm" and wire is sent
            and self.sharding is None))
        on_done = None
        if self.tracer is not None:
            record = self.tracer.comm_launched(bucket.index, wire.numel() * wire.element_size(),
                                               "allreduce" if self.sharding is None else "reduce-scatter")
            on_done = lambda: self.tracer.comm_done(record)  # noqa: E731
        tag = Tag("gradient", bucket.index, step=self._synced_steps)  # what a failure calls this collective
        if self.sharding is not None:
            return self.sharding.reduce_scatter(bucket, sent, wire, tag=tag, on_done=on_done)
        handle = self._comm.allreduce_async(wire, algorithm=self.algorithm, tag=tag, on_done=on_done,
                                            **({} if notes is None else {"notes": notes}))  # (a caller's comm: none)
        return handle if wire is sent else DecompressingHandle(handle, wire, sent)

    def finish_gradient_sync(self) -> None:
        """The one wait point after backward: afterwards every bucket holds the sum over ranks.
        Launches, in bucket order, every bucket no hook launched (without overlap: all; with it, those
        not complete: unused parameters, an empty shard's), then waits every handle once; under no_sync(), nothing.
        With no backward since the last sync it still joins the peers' collectives; the gradient stays as it was."""
        if self._closed:
            raise Misuse("dp.finish_gradient_sync() after dp.close(): a closed replica exchanges nothing; "
                         "close it after the last step, or phalanx.prepare the model again to go on training")
        if not self._sync_enabled:
            return
        if not self.exchanging:  # nothing to sum, but a gradient to check all the same
            if self._capturing:
                return
            self.world.check_here("this replica")  # one prepared before phalanx.launch forked this worker
            self._params.checked()
            self._synced_steps += 1
            return self._finite.after_local_step(self.named_gradients, step=self._synced_steps)
        written = self._usage.written() if self._usage is not None else []  # by the script since landing
        self._layout.take_back()  # gradients dropped at the last sync, or by optimizer.zero_grad(), back
        self._scheduler.finish()
        self._unsynced.pending = self._unsynced.accumulating = False
        self._format.agree(self.allreduce_now, world_size=self.world.world_size, device=self.world.device)
        # Checked after the exchange, so a rank that fails here still matched its peers' calls.
        if (self.sharding is None or self.sharding.keeps_gradients) and not grads_are_bucket_views(self.buckets):
            check_gradients_aliased(self._usage, self.module, compiled_after_prepare=self.compiled_after_prepare,
                                    sharded=self.sharding is not None)
        # What no rank used loses its gradient, as on one device; small sums apart if need be (layout.py).
        if laid_out_again := self._layout.after_sum(lambda flat: self.allreduce_now(
                flat, Tag("gradient", len(self.buckets), step=self._synced_steps))):
            self._rewire()
        self._synced_steps += 1
        summed = [b.buffer for b in self.buckets] if self.sharding is None else self.sharding.shard_grads
        self._finite.after_sum(summed, step=self._synced_steps, allreduce=self._finite_check_sum,
                               laid_out_again=laid_out_again)
        self._replicas.after_step(self._synced_steps)
        self._extras.after_exchange(summed, self.allreduce_now)
        self._layout.end_sync(lambda flat: self.allreduce_now(flat, Tag("sparse gradient rows")))
        if written:  # raised last: this rank has joined every collective of the sync
            raise gradients_written(written, self.module)

    @property
    def unused_at_last_sync(self) -> set[int]:
        """id() of each parameter no rank's backward reached before the last sync (usage.py)."""
        return self._usage.unused if self._usage is not None else set()

    def check_synced(self, what: str) -> None:
        """Raise, naming `what`, if a synced backward's gradients were never exchanged."""
        if self._unsynced is not None:
            self._unsynced.check(what)

    def optimizer(self, cls: type, params=None, *, elementwise: bool | None = None, **defaults) -> torch.optim.Optimizer:
        """`cls(params or this replica's parameters, **defaults)`; with `shard=`, over this rank's
        share of them (sharding/optim.py: any element-wise torch optimizer, param groups as torch's)."""
        return make_optimizer(self, cls, params, elementwise=elementwise, **defaults)

    def allreduce_now(self, flat: torch.Tensor, tag: Tag = ALLREDUCE) -> None:
        self._comm.allreduce(flat, algorithm=self.algorithm, tag=tag)

    def close(self) -> None:
        """Check the steps since the last NaN/Inf check, compare the replicas and gather stage 3's parameters whole
        into the module (every rank, unless an error is on its way: the module is a plain model again), then remove
        the hooks and stop the AsyncComm this replica made; call before stop_world."""
        try:
            if not self._closed and sys.exc_info()[1] is None:
                self.check_finite(where="close()")
                self.check_replicas(where="close()")
                if self.sharding is not None:  # stage 3: its parameters whole again, for good (a collective)
                    self.sharding.leave_whole()
        finally:
            self._close()

    def _close(self) -> None:
        self._hook_handles = unhooked(self._hook_handles)
        for part in (self._unsynced, self._closures, self._extras, self._replicas, self.sharding):
            if part is not None:
                part.close()
        if self._routes_bn:
            route_sync_batchnorm(self.module, None)
        if self._comm is not None and self._owns_comm:
            self._comm.close()
        self._comm, self._scheduler, self._closed = None, None, True
