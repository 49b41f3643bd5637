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
What this does not own: bucketing and deciding when to launch (`phalanx.parallel`).
"""

from __future__ import annotations

import contextlib
import datetime
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch
import torch.distributed as dist

from phalanx.comm.algorithms import ALGORITHMS, P2P_ALGORITHMS, allreduce_fn, apply_flat
from phalanx.comm.shm import ShmGroup
from phalanx.comm.transport import DistTransport
from phalanx.world import World


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
        if world.distributed:
            if any(a in P2P_ALGORITHMS for a in self.algorithms):
                # Same backend as the world (gloo on CPU): p2p on CUDA tensors needs NCCL.
                # Its own timeout: new_group's default is torch's 30 minutes, not the world's.
                self._group = dist.new_group(backend=world.backend, timeout=datetime.timedelta(seconds=world.timeout_s))
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
        extra = {} if algorithm == "native" else {"transport": self._transport(algorithm)}
        apply_flat(tensor, lambda flat: fn(flat, world=self.world, **extra))
        return tensor

    def allreduce_async(
        self, tensor: torch.Tensor, *, algorithm: str = "native", on_done: Callable[[], None] | None = None
    ) -> Handle:
        """Start summing `tensor` in place across the world; the result is there after `wait()`.

        `on_done()` runs as soon as the backend has finished (on its thread, before any wait):
        how a trace learns when communication really ended.
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
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True)
            if on_done is not None:
                work.get_future().add_done_callback(lambda _: on_done())
            return Handle(tensor, copy_back, work.wait)
        transport = self._transport(algorithm)
        future: Future = self._executor.submit(_run_no_grad, fn, flat, self.world, transport)
        if on_done is not None:
            future.add_done_callback(lambda _: on_done())
        return Handle(tensor, copy_back, future.result)

    def close(self) -> None:
        """Finish queued work, stop the thread, leave the private group, unmap; safe to call twice."""
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)
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


def _run_no_grad(fn: Callable[..., None], flat: torch.Tensor, world: World, transport) -> None:
    # The current CUDA device is per thread: pin this one to the tensor's (a no-op on CPU).
    with torch.no_grad(), torch.cuda.device(flat.device) if flat.is_cuda else contextlib.nullcontext():
        fn(flat, world=world, transport=transport)
