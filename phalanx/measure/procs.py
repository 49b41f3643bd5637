"""Fresh processes for the contenders that are *not* phalanx: torch DDP and plain PyTorch loops.

phalanx's own configurations start through `phalanx.runtime.launch` (the path a user gets). A DDP or
single-process user gets none of that, so their processes start with no process group opened for
them, no torchrun environment, a fixed thread count, the allocator setting only when asked, and
`fn(rank=, num_procs=, port=, job=)` left to open its own group (rank 0 hosting the store at
`port`, as under `torch.multiprocessing.spawn`). They run through the same supervisor as
phalanx's workers (phalanx.runtime.supervise: one report each before teardown, a deadline, every child
reaped); only the body each process runs differs.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Any, Callable

import torch

from phalanx.runtime.binding import keep_freed_memory_mapped
from phalanx.runtime.supervise import WorkerSet, run_workers
from phalanx.runtime.worker_errors import WorkerFailed
from phalanx.runtime.world import leave_default_group


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it: bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _contender_body(rank: int, payload, teardown: contextlib.ExitStack) -> Any:
    fn, job, num_procs, port, threads, tune_allocator = payload
    torch.set_num_threads(threads)
    if tune_allocator:
        keep_freed_memory_mapped()
    teardown.callback(leave_default_group)  # after the report: see phalanx.runtime.supervise
    return fn(rank=rank, num_procs=num_procs, port=port, job=job)


def run_fresh(fn: Callable[..., Any], job: Any, *, num_procs: int, threads: int, tune_allocator: bool,
              deadline_s: float, name: str = "run") -> list[Any]:
    """Start `num_procs` fresh processes running `fn`; return their results by rank."""
    if num_procs < 1 or threads < 1:
        raise ValueError(f"need at least one process and one thread, got {num_procs} x {threads}")
    workers = WorkerSet(body=_contender_body, payload=(fn, job, num_procs, free_port(), threads, tune_allocator),
                        num_procs=num_procs, name=f"phalanx-bench-{name}", deadline_s=deadline_s)
    try:
        return run_workers(workers)
    except WorkerFailed as exc:
        raise WorkerFailed(f"{name}: {exc}") from None
