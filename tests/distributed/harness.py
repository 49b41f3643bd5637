"""Run a function on k local gloo processes and collect what each returns: the one way
distributed tests start workers.

    results = run_workers(fn, world_size, *args, timeout_s=60)

spawns `world_size` fresh processes (the `spawn` start method, CPU only), which rendezvous on
127.0.0.1 at a free port through `phalanx.world.start_world`, each call `fn(world, *args)` and
send back its return value; `results[rank]` is rank `rank`'s value. `fn` must be a
module-level function (spawn pickles it by name) and its result picklable; tensors are fine.

The parent fails the test (`WorkersFailed`, an AssertionError) as soon as any worker raises
(with every worker traceback it can collect), exits without a result, or exits non-zero,
and when the whole run exceeds `timeout_s` (a hung collective), killing every child in all
cases, so a broken collective fails in seconds instead of stalling CI.

One tolerated failure: gloo occasionally aborts a process (SIGABRT) while it exits, after
`destroy_process_group` (about 1 run in 80 on 2 processes, see the baselines' "Traps"). A worker
that already delivered its result and then dies of SIGABRT counts as a success, with a warning.

Start-up costs about 2 s per process (`import torch`), so batch many checks into one call.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import signal
import socket
import time
import traceback
import warnings
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

import torch

from phalanx.world import start_world, stop_world

# Bounds every collective inside a worker; the harness's own timeout_s bounds the whole run.
WORKER_COLLECTIVE_TIMEOUT_S = 30.0
# After a first failure, how long to keep listening for the other ranks' tracebacks (the first
# one to arrive is often a secondary "connection closed" from a peer of the rank that broke).
ERROR_GRACE_S = 1.0


class WorkersFailed(AssertionError):
    """A worker raised, hung, or died; the message holds what each rank reported."""


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (the OS picks it: bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker_main(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, conn: Connection) -> None:
    """Entry point of one spawned worker: join the world, run fn, send (status, payload) back."""
    torch.set_num_threads(1)  # k workers share 2 cores; more threads only oversubscribe
    world = None
    try:
        world = start_world(
            rank=rank,
            world_size=world_size,
            local_rank=rank,
            local_world_size=world_size,
            device=torch.device("cpu"),
            master_addr="127.0.0.1",
            master_port=port,
            timeout_s=WORKER_COLLECTIVE_TIMEOUT_S,
        )
        # Pickle here, not in a queue's feeder thread, so an unpicklable result is reported as
        # this worker's error instead of being lost; plain pickle copies tensor data into the
        # bytes (no shared-memory handles that would die with this process).
        message = pickle.dumps(("ok", fn(world, *args)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        message = pickle.dumps(("error", traceback.format_exc()))
    # Deliver before teardown: send_bytes returns once the whole message is in the pipe, so an
    # abort inside destroy_process_group or at interpreter exit can no longer lose it.
    conn.send_bytes(message)
    conn.close()
    stop_world(world)


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60.0) -> list[Any]:
    """Run `fn(world, *args)` on `world_size` spawned CPU processes; return their results by rank."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    port = free_port()
    procs, conns = [], []
    for rank in range(world_size):
        parent_end, child_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_worker_main, args=(fn, rank, world_size, port, args, child_end), name=f"phalanx-worker-{rank}"
        )
        proc.start()
        child_end.close()  # keep only the child's copy, so its death reads as EOF here
        procs.append(proc)
        conns.append(parent_end)

    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        _collect(procs, conns, results, errors, deadline, timeout_s)
        if not errors:
            _join(procs, results, errors, deadline)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(5)
        for conn in conns:
            conn.close()
    if errors:
        report = "\n".join(f"--- rank {rank} ---\n{errors[rank]}" for rank in sorted(errors))
        raise WorkersFailed(f"{len(errors)} of {world_size} workers failed running {fn.__qualname__}:\n{report}")
    return [results[rank] for rank in range(world_size)]


def _collect(procs, conns, results: dict, errors: dict, deadline: float, timeout_s: float) -> None:
    """Read each worker's message; stop early (after a grace period) once any worker failed."""
    pending = dict(enumerate(conns))
    give_up_at = deadline
    while pending:
        remaining = give_up_at - time.monotonic()
        if remaining <= 0:
            if not errors:
                for rank in pending:
                    errors[rank] = f"no result within timeout_s={timeout_s:g} (hung in a collective?)"
            else:
                for rank in pending:
                    errors.setdefault(rank, "no result (stopped waiting after another rank failed)")
            return
        for conn in wait(list(pending.values()), timeout=remaining):
            rank = next(r for r, c in pending.items() if c is conn)
            del pending[rank]
            try:
                status, payload = pickle.loads(conn.recv_bytes())
            except EOFError:
                procs[rank].join(1)
                status, payload = "error", f"exited without a result (exit code {procs[rank].exitcode})"
            if status == "ok":
                results[rank] = payload
            else:
                errors[rank] = payload
                give_up_at = min(give_up_at, time.monotonic() + ERROR_GRACE_S)


def _join(procs, results: dict, errors: dict, deadline: float) -> None:
    """Wait for every worker to exit; judge exit codes (SIGABRT after a result is tolerated)."""
    for rank, proc in enumerate(procs):
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.exitcode is None:
            errors[rank] = "delivered its result but did not exit before the timeout (hung in teardown?)"
        elif proc.exitcode == -signal.SIGABRT and rank in results:
            warnings.warn(f"rank {rank} aborted (SIGABRT) after delivering its result: known gloo exit-time abort")
        elif proc.exitcode != 0:
            errors[rank] = f"delivered its result but exited with code {proc.exitcode}"
