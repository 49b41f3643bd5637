"""Fresh processes for the contenders that are *not* phalanx: torch DDP and plain PyTorch loops.

phalanx's own configurations start through `phalanx.launch` (the path a user gets, allocator
setting included). A DDP or single-process user gets none of that, so their processes start here,
the way `torch.multiprocessing.spawn` would start them: fresh interpreters with the environment
as it is (the allocator setting only when asked), a fixed thread count, and `fn(rank=, num_procs=,
port=, job=)` left to open its own process group. Each child sends its result before it leaves
the group (the gloo exit-time abort of BASELINES.md cannot lose it); the whole run is bounded by
a deadline, and every child is reaped on every path.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import socket
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from phalanx.launch import CPU_ALLOCATOR_ENV

EXIT_GRACE_S = 10.0  # a finished child may take this long to tear down before it is killed


@contextlib.contextmanager
def _environ(extra: Mapping[str, str]) -> Iterator[None]:
    """Add `extra` to os.environ while children start (spawn copies it); a user's own value wins."""
    saved = {key: os.environ.get(key) for key in extra}
    try:
        for key, value in extra.items():
            os.environ.setdefault(key, value)
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it: bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _child(rank: int, num_procs: int, port: int, threads: int, fn: Callable[..., Any], job: Any, conn) -> None:
    torch.set_num_threads(threads)
    try:
        report = pickle.dumps(("ok", fn(rank=rank, num_procs=num_procs, port=port, job=job)))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        report = pickle.dumps(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    try:
        conn.send_bytes(report)  # before teardown: see the module docstring
        conn.close()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_fresh(fn: Callable[..., Any], job: Any, *, num_procs: int, threads: int, allocator_env: bool,
              deadline_s: float, name: str = "run") -> list[Any]:
    """Start `num_procs` fresh processes running `fn`; return their results by rank."""
    if num_procs < 1 or threads < 1:
        raise ValueError(f"need at least one process and one thread, got {num_procs} x {threads}")
    ctx = mp.get_context("spawn")
    port = free_port()
    procs, conns = [], []
    try:
        with _environ(CPU_ALLOCATOR_ENV if allocator_env else {}):
            for rank in range(num_procs):
                parent_end, child_end = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_child, args=(rank, num_procs, port, threads, fn, job, child_end),
                                   name=f"phalanx-bench-{name}-{rank}")
                proc.start()
                child_end.close()  # only the child holds it now: its death reads as EOF here
                procs.append(proc)
                conns.append(parent_end)
        results = _collect(procs, conns, deadline=time.monotonic() + deadline_s, name=name)
        for proc in procs:  # let them leave the group before the next configuration starts
            proc.join(EXIT_GRACE_S)
        return results
    finally:
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()
            proc.join()
        for conn in conns:
            conn.close()


def _collect(procs, conns, *, deadline: float, name: str) -> list[Any]:
    results: dict[int, Any] = {}
    pending = set(range(len(procs)))
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RuntimeError(f"{name}: ranks {sorted(pending)} gave no result before the deadline (hung?)")
        ready = set(wait([conns[r] for r in pending] + [procs[r].sentinel for r in pending], remaining))
        for rank in sorted(r for r in pending if conns[r] in ready or procs[r].sentinel in ready):
            try:
                status, payload = pickle.loads(conns[rank].recv_bytes())
            except (EOFError, OSError):
                procs[rank].join(1)
                raise RuntimeError(f"{name}: rank {rank} died without a result (exit code {procs[rank].exitcode})")
            if status != "ok":
                raise RuntimeError(f"{name}: rank {rank} failed: {payload}")
            results[rank] = payload
            pending.discard(rank)
    return [results[rank] for rank in range(len(procs))]
