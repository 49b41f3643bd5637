"""Asynchronous allreduce: launch now, `wait()` later, so communication can overlap backward.

`AsyncComm` owns what the hand-written algorithms need to run off the main thread: one
background thread, a process group of its own for the point-to-point ones (`dist.new_group`,
gloo on CPU), so their messages never interleave with the main thread's collectives, and the
shared segment for `shm`. It opens only what the algorithms it is told about need. `native`
needs none of it: it uses the backend's own async all_reduce (`async_op=True`) on the default
group. `allreduce()` runs the same algorithms synchronously, on the caller's thread.

Ordering is what keeps ranks matched: every rank must launch the same allreduces in the same
order (as DDP launches buckets in the same order). Native launches go straight to the backend
in call order; the other algorithms run one at a time on the single thread, in launch order.

A `Handle` belongs to whoever launched it and is waited exactly once; until then the tensor
must not be read or written (picotron and DDP follow the same contract for their buckets).
What this does not own: bucketing and deciding when to launch (`phalanx.data_parallel`).

One deadline, whatever is in flight (issue 21): each launch is entered on the collective board
with its tag, and its wait is the watchdog's (watchdog.py). Once a job on the thread fails, the
jobs queued behind it fail at once instead of each waiting out its own timeout (27 queued
buckets took 27 timeouts), and `close()` cancels what is queued and tells a wait in progress on
the shared segment to give up, so teardown after a failure takes at most a poll interval.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch
import torch.distributed as dist

from phalanx.comm.algorithms import ALGORITHMS, P2P_ALGORITHMS, allreduce_fn, apply_flat
from phalanx.runtime.board import COMM, WORLD, Ticket
from phalanx.comm.shm import ShmGroup
from phalanx.comm.transport import DistTransport
from phalanx.comm.watchdog import CommError, check_pairing, collective, wait_future, wait_work, waiting
from phalanx.runtime.world import World


class CollectiveAborted(CommError):
    """A queued collective that was not run because an earlier one on the same thread failed."""


class Handle:
    """One launched allreduce. `wait()` blocks until done, writes back, returns the tensor."""

    def __init__(self, tensor: torch.Tensor, flat: torch.Tensor | None, wait_fn: Callable[[], None]) -> None:
        self._tensor = tensor
        self._flat = flat  # a contiguous copy to write back, or None when the tensor was used as is
        self._wait_fn = wait_fn
        self._waited = False

    @property
    def waited(self) -> bool:
        return self._waited

    def wait(self) -> torch.Tensor:
        assert not self._waited, "allreduce handle waited twice"
        self._waited = True
        self._wait_fn()
        if self._flat is not None:
            with torch.no_grad():
                self._tensor.copy_(self._flat.view(self._tensor.shape))
        return self._tensor


def _done() -> None:
    return None


class AsyncComm:
    """Background thread, private group and shared segment for allreduces; close before stop_world.

    `algorithms`: the ones this will be asked to run (default: all but shm, which maps a segment).
    Construct it at the same point on every rank: opening a group or a segment is a collective.
    """

    def __init__(self, *, world: World, algorithms=None) -> None:
        self.world = world
        self.algorithms = tuple(a for a in ALGORITHMS if a != "shm") if algorithms is None else tuple(algorithms)
        for algorithm in self.algorithms:
            allreduce_fn(algorithm)  # ValueError naming the valid ones
        self._group: dist.ProcessGroup | None = None
        self._executor: ThreadPoolExecutor | None = None
        self.shm: ShmGroup | None = None
        self._closed = False
        self._failure: BaseException | None = None  # the first job on the thread that failed
        if world.distributed:
            if any(a in P2P_ALGORITHMS for a in self.algorithms):
                # Same backend as the world (gloo on CPU): p2p on CUDA tensors needs NCCL.
                # Its own timeout: new_group's default is torch's 30 minutes, not the world's.
                with collective(world, "set-up"):
                    self._group = dist.new_group(backend=world.backend,
                                                 timeout=datetime.timedelta(seconds=world.timeout_s))
            if "shm" in self.algorithms:
                self.shm = ShmGroup(world=world)
            if any(a != "native" for a in self.algorithms):
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="phalanx-comm")

    def _transport(self, algorithm: str):
        if algorithm not in self.algorithms:
            raise ValueError(f"AsyncComm was opened for {', '.join(self.algorithms)}, not {algorithm}; "
                             f"pass algorithms=(..., {algorithm!r}) when constructing it")
        return self.shm if algorithm == "shm" else DistTransport(group=self._group)

    @torch.no_grad()
    def allreduce(self, tensor: torch.Tensor, *, algorithm: str = "native") -> torch.Tensor:
        """Sum `tensor` in place now, on this thread, with this comm's resources; return it."""
        fn = allreduce_fn(algorithm)
        if not self.world.distributed:
            return tensor
        if self._closed:
            raise RuntimeError("AsyncComm is closed")
        if algorithm == "native":
            return self.allreduce_async(tensor, algorithm="native").wait()
        transport = self._transport(algorithm)
        ticket = self._enter(COMM, tensor)
        with waiting(self.world, ticket):
            apply_flat(tensor, lambda flat: self._run(fn, flat, transport, ticket))
        return tensor

    def allreduce_async(
        self, tensor: torch.Tensor, *, algorithm: str = "native", on_done: Callable[[], None] | None = None
    ) -> Handle:
        """Start summing `tensor` in place across the world; the result is there after `wait()`.

        `on_done()` runs as soon as the backend has finished (on its thread, before any wait):
        how a trace learns when communication really ended. The call is entered on the collective
        board as a plain "allreduce", or as what an enclosing `board.tagged(...)` says it is.
        """
        fn = allreduce_fn(algorithm)
        if not self.world.distributed:
            if on_done is not None:
                on_done()
            return Handle(tensor, None, _done)
        if self._closed:
            raise RuntimeError("AsyncComm is closed")
        with torch.no_grad():
            flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        copy_back = None if tensor.is_contiguous() else flat
        if algorithm == "native":
            ticket = self._enter(WORLD, flat)
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True)
            if on_done is not None:
                work.get_future().add_done_callback(lambda _: on_done())
            return Handle(tensor, copy_back, functools.partial(wait_work, work, world=self.world, ticket=ticket))
        transport = self._transport(algorithm)
        ticket = self._enter(COMM, flat)
        future: Future = self._executor.submit(self._run, fn, flat, transport, ticket)
        if on_done is not None:
            future.add_done_callback(lambda _: on_done())
        return Handle(tensor, copy_back, functools.partial(wait_future, future, world=self.world, ticket=ticket))

    def _enter(self, channel: int, tensor: torch.Tensor) -> Ticket | None:
        board = self.world.board
        return None if board is None else board.enter(channel, "allreduce", 0, tensor.numel() * tensor.element_size())

    def _run(self, fn: Callable[..., None], flat: torch.Tensor, transport, ticket: Ticket | None) -> None:
        """One job (on the thread, or inline for a synchronous call): refused once one has failed."""
        if self._failure is not None:
            first = (str(self._failure).splitlines() or [""])[0]
            raise CollectiveAborted(f"not run: an earlier collective on the communication thread failed "
                                    f"({type(self._failure).__name__}: {first})")
        try:
            # The current CUDA device is per thread: pin this one to the tensor's (a no-op on CPU).
            with torch.no_grad(), torch.cuda.device(flat.device) if flat.is_cuda else contextlib.nullcontext():
                if isinstance(transport, ShmGroup):
                    fn(flat, world=self.world, transport=transport, ticket=ticket)  # checks its pairing
                else:
                    fn(flat, world=self.world, transport=transport)
                    check_pairing(self.world, ticket)
        except BaseException as exc:
            if self._failure is None:
                self._failure = exc
            raise

    def close(self) -> None:
        """Stop the thread, leave the private group, unmap; safe to call twice.

        After a normal step nothing is queued. After a failure, queued jobs are cancelled and a
        wait on the shared segment in progress gives up at its next poll (a peer that will never
        arrive must not hold teardown for another timeout per queued bucket)."""
        self._closed = True
        if self.shm is not None:
            self.shm.abort()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
        self._group = None

    def __enter__(self) -> "AsyncComm":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
