"""Asynchronous collectives: launch now, `wait()` later, so communication can overlap backward.

`AsyncComm` owns what the hand-written algorithms need to run off the main thread: one
background thread, a process group of its own for the point-to-point ones (`dist.new_group`,
gloo on CPU), so their messages never interleave with the main thread's collectives, and the
shared segment for `shm`; only what its algorithms need. `native` uses the backend's own async
ops (`async_op=True`) on the default group. It launches allreduce, reduce-scatter and all-gather
(`*_async`); `allreduce()`, `reduce_scatter()` and `all_gather()` run them synchronously.

Ordering keeps ranks matched: every rank launches the same collectives in the same order (as
DDP launches buckets). Native launches go straight to the backend; the others run one at a time
on the thread, in launch order (opened `threaded=False`: to their end, on the caller's thread).
A synchronous call runs on the caller's thread only while the thread is idle, and behind queued
jobs joins the queue: both on one segment at once mixed their sums (a replica closed with
buckets in flight compared garbage).

Every collective takes its identity as an argument, a `Tag` (phase, bucket, step). One launch
path serves every algorithm and collective (`_launch`; `_now` the synchronous form): the call is
entered on the collective board with its tag, and waited and settled alike (calls.py); a
reduce-scatter or all-gather brings only its native launch and its job (shards.py). A `Handle`
(handle.py) is waited once by whoever launched it; bucketing is phalanx.data_parallel's.

One deadline, whatever is in flight: once a job on the thread fails, those queued behind it fail
at once (27 queued buckets would wait 27 timeouts), and `close()` cancels the queue and tells a
wait on the shared segment to give up at its next poll. `open_comm` opens a replica's AsyncComm
and says why `auto` fell back to native (on every rank alike) where no segment could be set up.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from phalanx.comm.algorithms import ALGORITHMS, P2P_ALGORITHMS, allreduce_fn, apply_flat, resolve_algorithm
from phalanx.comm.calls import collective, enter, run_now, wait_future, wait_work, when_completed
from phalanx.comm.handle import Handle, done, flat_of
from phalanx.comm.hierarchical import Hierarchy
from phalanx.comm.hosts import LayoutError
from phalanx.comm.shards import ALL_GATHER, ALL_GATHER_TAG, REDUCE_SCATTER, REDUCE_SCATTER_TAG, prepare
from phalanx.comm.shm import ShmError, ShmGroup
from phalanx.comm.transport import DistTransport
from phalanx.comm.watchdog import CommError
from phalanx.errors import PeerLost
from phalanx.runtime.binding import run_single_threaded
from phalanx.runtime.board import COMM, WORLD, Ticket
from phalanx.runtime.tags import Tag
from phalanx.runtime.world import World

COMM_THREAD = "phalanx-comm"  # the communication thread's name, in /proc and py-spy too
ALLREDUCE = Tag()  # what a caller that does not say what its collective is for gets
_SET_UP = Tag("set-up")
_GRAD_MODE_AS_IS = contextlib.nullcontext()  # reusable: no_grad's 2-3 µs are a tenth of a small call


def _start_comm_thread() -> None:
    """The communication thread's set-up: single-threaded ATen ops, its OS name, and grad mode off
    for good (grad mode is per thread; its jobs only sum and copy buffers)."""
    run_single_threaded(COMM_THREAD)
    torch.set_grad_enabled(False)


class CollectiveAborted(CommError, PeerLost):
    """A queued collective that was not run because an earlier one on the same thread failed."""


# A job: the algorithm's work on a transport, told its ticket (a transport that polls reads it).
Job = Callable[[object, Ticket | None], "bool | None"]  # True: its transport compared the peers' tags (calls.py)


def _cuda_of(flat: torch.Tensor) -> torch.device | None:
    """The CUDA device a job on `flat` runs with current; None for a CPU tensor (skips `.device`)."""
    return flat.device if flat.is_cuda else None


class AsyncComm:
    """Background thread, private group and shared segment for allreduces; close before stop_world.

    `algorithms`: the ones this will be asked to run (default: all but shm and hierarchical, which
    map segments). Construct it at the same point on every rank: opening a group or a segment is a
    collective. `compiled_rounds`: False runs the shm segment's rounds in Python (ShmGroup's).
    `threaded`: False starts no thread; a launch but a native one runs to its end on the caller's
    thread (where no core is free for a thread, handing it work only adds wake-ups to each call)."""

    def __init__(self, *, world: World, algorithms=None, compiled_rounds: bool = True, threaded: bool = True) -> None:
        self.world = world
        self.algorithms = (tuple(a for a in ALGORITHMS if a not in ("shm", "hierarchical")) if algorithms is None
                           else tuple(algorithms))
        for algorithm in self.algorithms:
            allreduce_fn(algorithm)  # ValueError naming the valid ones
        self._group: dist.ProcessGroup | None = None
        self._executor: ThreadPoolExecutor | None = None
        self.shm: ShmGroup | None = None
        self.hierarchy: Hierarchy | None = None
        self._closed = False
        self._failure: BaseException | None = None  # the first job on the thread that failed
        self._queued = self._finished = 0  # jobs handed to the thread, and those it ended (each counted by one thread)
        if world.distributed:
            if any(a in P2P_ALGORITHMS for a in self.algorithms):
                # Same backend as the world (gloo on CPU): p2p on CUDA tensors needs NCCL.
                # Its own timeout: new_group's default is torch's 30 minutes, not the world's.
                with collective(world, _SET_UP):
                    self._group = dist.new_group(backend=world.backend,
                                                 timeout=datetime.timedelta(seconds=world.timeout_s))
            if "shm" in self.algorithms:
                self.shm = ShmGroup(world=world, compiled=compiled_rounds)
            if "hierarchical" in self.algorithms:
                self.hierarchy = Hierarchy(world=world)
            if threaded and any(a != "native" for a in self.algorithms):
                # The thread sums and copies buckets beside backward, single-threaded (binding.py says
                # why); this thread's own team is fixed first, before the new one changes torch's default.
                torch.get_num_threads()
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=COMM_THREAD,
                                                    initializer=_start_comm_thread)

    @property
    def shm_rounds(self) -> str | None:
        """How this comm's shared segment runs its rounds ("compiled", or "Python (why)"); None: no segment."""
        segment = self.shm if self.shm is not None else getattr(self.hierarchy, "shm", None)
        return None if segment is None else segment.rounds

    def _transport(self, algorithm: str):
        if algorithm not in self.algorithms:
            raise ValueError(f"AsyncComm was opened for {', '.join(self.algorithms)}, not {algorithm}; "
                             f"pass algorithms=(..., {algorithm!r}) when constructing it")
        if algorithm == "shm":
            return self.shm
        return self.hierarchy if algorithm == "hierarchical" else DistTransport(group=self._group)

    def allreduce(self, tensor: torch.Tensor, *, algorithm: str = "native", tag: Tag = ALLREDUCE) -> torch.Tensor:
        """Sum `tensor` in place now, on this thread, with this comm's resources; return it."""
        fn = allreduce_fn(algorithm)
        if not self.world.distributed:
            return tensor
        def run(flat: torch.Tensor) -> None:
            self._now(algorithm, tag, flat, start=lambda: dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True),
                      job=lambda transport, ticket: fn(flat, world=self.world, transport=transport, ticket=ticket))
        if tensor.requires_grad:  # sums written in place must not be recorded by autograd
            with torch.no_grad():
                apply_flat(tensor, run)
        else:  # nothing to record (a bucket, a metric): no_grad's 2-3 µs would be a tenth of a small call
            apply_flat(tensor, run)
        return tensor

    def allreduce_async(self, tensor: torch.Tensor, *, algorithm: str = "native", tag: Tag = ALLREDUCE,
                        on_done: Callable[[], None] | None = None, notes: torch.Tensor | None = None) -> Handle:
        """Start summing `tensor` in place across the world; the result is there after `wait()`.

        `tag`: what the collective is, as a failure names it (a bucket: Tag("gradient", i, step=s)).
        `on_done()` runs as soon as the backend has finished (on its thread, before any wait; only
        if it completed, calls.py's `when_completed`): how a trace learns when communication ended.
        `notes` ("shm" only): the NaN/Inf check's two sums, taken as the data moves (ShmGroup.allreduce)."""
        fn = allreduce_fn(algorithm)
        fn = fn if notes is None else functools.partial(fn, notes=notes)  # no partial on the common path
        if not self.world.distributed:
            if on_done is not None:
                on_done()
            return Handle(tensor, None, done)
        flat, copy_back = flat_of(tensor)
        wait = self._launch(algorithm, tag, flat, on_done=on_done,
                            start=lambda: dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True),
                            job=lambda transport, ticket: fn(flat, world=self.world, transport=transport, ticket=ticket))
        return Handle(tensor, copy_back, wait)

    def reduce_scatter_async(self, flat: torch.Tensor, *, counts: Sequence[int], algorithm: str = "native",
                             tag: Tag = REDUCE_SCATTER_TAG, on_done: Callable[[], None] | None = None) -> Handle:
        """Start summing every rank's contiguous 1-D `flat` into each rank's own range (`counts`:
        elements per rank, in rank order; shards.py has the contract); `wait()` returns this
        rank's range, a view of `flat`. `on_done` as for allreduce_async."""
        return self._sharded(REDUCE_SCATTER, flat, counts, algorithm, tag, on_done=on_done)

    def all_gather_async(self, flat: torch.Tensor, *, counts: Sequence[int], algorithm: str = "native",
                         tag: Tag = ALL_GATHER_TAG, on_done: Callable[[], None] | None = None) -> Handle:
        """Start giving every rank every rank's range of `flat` (rank r's piece: counts[r] elements,
        in place on entry); `wait()` returns `flat`, bitwise alike on every rank."""
        return self._sharded(ALL_GATHER, flat, counts, algorithm, tag, on_done=on_done)

    def reduce_scatter(self, flat: torch.Tensor, *, counts: Sequence[int], algorithm: str = "native",
                       tag: Tag = REDUCE_SCATTER_TAG) -> torch.Tensor:
        """`reduce_scatter_async`, run now on this thread: returns this rank's range of `flat`."""
        return self._sharded(REDUCE_SCATTER, flat, counts, algorithm, tag, now=True)

    def all_gather(self, flat: torch.Tensor, *, counts: Sequence[int], algorithm: str = "native",
                   tag: Tag = ALL_GATHER_TAG) -> torch.Tensor:
        """`all_gather_async`, run now on this thread: returns `flat`."""
        return self._sharded(ALL_GATHER, flat, counts, algorithm, tag, now=True)

    def _sharded(self, op: str, flat: torch.Tensor, counts: Sequence[int], algorithm: str, tag: Tag, *,
                 on_done: Callable[[], None] | None = None, now: bool = False):
        """A reduce-scatter or all-gather through the one launch path: its result now, or its Handle."""
        if flat.requires_grad:  # results written in place must not be recorded by autograd
            with torch.no_grad():
                return self._sharded(op, flat.detach(), counts, algorithm, tag, on_done=on_done, now=now)
        call = prepare(op, flat, counts=counts, world=self.world, algorithm=algorithm, tag=tag)
        if not self.world.distributed:
            if on_done is not None:
                on_done()
            return call.result if now else Handle(call.result, None, done)
        if now:
            self._now(algorithm, call.tag, flat, start=call.start, job=call.job)
            return call.result
        return Handle(call.result, None, self._launch(algorithm, call.tag, flat, start=call.start, job=call.job,
                                                      on_done=on_done))

    def _launch(self, algorithm: str, tag: Tag, flat: torch.Tensor, *, start: Callable[[], object], job: Job,
                on_done: Callable[[], None] | None) -> Callable[[], None]:
        """Launch one collective of any kind and return its wait. `start()`: its native form (the
        backend's async op on the default group); `job`: every other algorithm's, queued on the
        thread in launch order. Entered on the board under `tag` before it starts."""
        if self._closed:
            raise RuntimeError("AsyncComm is closed")
        size_bytes = flat.numel() * flat.element_size()
        if algorithm == "native":
            ticket = enter(self.world, WORLD, tag, size_bytes, dtype=flat.dtype, check_peers=True)
            work = start()
            if on_done is not None:
                work.get_future().add_done_callback(when_completed(on_done))
            return functools.partial(wait_work, work, world=self.world, ticket=ticket)
        if self._executor is None:  # no thread: run now, grad mode off (as the thread's) where it matters
            with torch.no_grad() if flat.requires_grad else _GRAD_MODE_AS_IS:
                self._now(algorithm, tag, flat, start=start, job=job)
            if on_done is not None:
                on_done()
            return done  # nothing left to wait for
        transport = self._transport(algorithm)
        ticket = enter(self.world, COMM, tag, size_bytes, dtype=flat.dtype, check_peers=algorithm != "shm")
        self._queued += 1
        future: Future = self._executor.submit(self._run, job, _cuda_of(flat), transport, ticket, True)
        if on_done is not None:  # not for a job cancelled, refused or failed (a trace would draw it done)
            future.add_done_callback(when_completed(on_done))
        return functools.partial(wait_future, future, world=self.world, ticket=ticket)

    def _now(self, algorithm: str, tag: Tag, flat: torch.Tensor, *, start: Callable[[], object], job: Job) -> None:
        """`_launch`'s synchronous form: native through the backend, the others on this thread."""
        if algorithm == "native" or self._finished != self._queued:  # native, or behind the thread's jobs
            self._launch(algorithm, tag, flat, start=start, job=job, on_done=None)()
            return
        if self._closed:
            raise RuntimeError("AsyncComm is closed")
        transport = self._transport(algorithm)
        run_now(self.world, COMM, tag, flat.numel() * flat.element_size(), lambda ticket: self._run(
            job, _cuda_of(flat), transport, ticket), dtype=flat.dtype, check_peers=algorithm != "shm")

    def _run(self, job: Job, cuda: torch.device | None, transport, ticket: Ticket | None,
             queued: bool = False) -> bool | None:
        """One job (`queued`: on the thread, counted when it ends; else inline, a synchronous call):
        refused once one has failed; its result (True: its transport compared the peers' tags, calls.py)."""
        try:  # grad mode is off: the caller's `no_grad`, or the thread's own (_start_comm_thread)
            if self._failure is not None:
                first = (str(self._failure).splitlines() or [""])[0]
                raise CollectiveAborted(f"not run: an earlier collective on the communication thread failed "
                                        f"({type(self._failure).__name__}: {first})")
            if cuda is not None:
                with torch.cuda.device(cuda):  # the current CUDA device is per thread: the tensor's
                    return job(transport, ticket)
            return job(transport, ticket)
        except BaseException as exc:
            if self._failure is None:
                self._failure = exc
            raise
        finally:
            self._finished += queued

    def close(self) -> None:
        """Stop the thread, leave the private group, unmap; safe to call twice.

        After a normal step nothing is queued. After a failure, queued jobs are cancelled and a
        wait on the shared segment in progress gives up at its next poll (a peer that will never
        arrive must not hold teardown for another timeout per queued bucket)."""
        self._closed = True
        if self.shm is not None:
            self.shm.abort()
        if self.hierarchy is not None:
            self.hierarchy.abort()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if self.hierarchy is not None:
            self.hierarchy.close()
            self.hierarchy = None
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
        self._group = None

    def __enter__(self) -> "AsyncComm":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class OpenedComm(NamedTuple):
    """What `open_comm` opened: the comm, the algorithm it runs, and why auto fell back (or None)."""

    comm: AsyncComm
    algorithm: str
    fallback_reason: str | None


def open_comm(world: World, choice: str, *, threaded: bool = True) -> OpenedComm:
    """The AsyncComm that runs allreduce `choice` (auto or a name) on `world`: a collective, so
    call it at the same point on every rank. `auto` means the fastest that works here: where the
    shared segment cannot be set up (a full /dev/shm, say) it falls back to native, and every
    rank alike, since each learned the same failure (the segment's set-up all-gathers it, as
    the hosts' layout is). `threaded`: AsyncComm's (False: calls run on the caller's thread)."""
    algorithm = resolve_algorithm(choice, world)
    try:
        return OpenedComm(AsyncComm(world=world, algorithms=(algorithm,), threaded=threaded), algorithm, None)
    except (ShmError, LayoutError) as exc:
        if choice != "auto":
            raise
        return OpenedComm(AsyncComm(world=world, algorithms=("native",), threaded=threaded), "native", str(exc))
