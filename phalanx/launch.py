"""Start the workers of a run: spawn k local processes, or join a job torchrun already started.

A local run spawns one process per device (fresh interpreters, `spawn`), rendezvous through a
file in a private temporary directory (so no TCP store listens on any interface; gloo's and
NCCL's own sockets are pinned to the loopback interface), and supervises them: each worker sends its result (or its error)
through its own pipe, the first failure takes every worker down (SIGTERM, then SIGKILL; all
joined, so no orphans and no zombies), and the message names the rank and what happened. The
launcher stopped with SIGTERM or SIGHUP takes its workers down the same way before it exits, and
a launcher killed outright takes them with it (Linux: each worker asks the kernel for SIGKILL
when its parent dies); shared-memory segments a dead worker may leave are removed. A
worker delivers its result *before* leaving the process group, so the rare gloo abort at process
exit (BASELINES.md: ~1 in 80 runs, SIGABRT after destroy_process_group) cannot turn a finished
run into a failure. CPU workers get `cores / k` threads (with `bind_cores`, each its own slice of
the cores: binding.py) and an allocator setting that keeps freed
activations mapped (BASELINES.md: page faults cost 6-13% of a batch-256 step, up to 1.5x at 1024).
The distributed tests start their workers through this same code (tests/distributed/harness.py).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import signal
import socket
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, replace
from multiprocessing.connection import wait
from typing import Any, Callable

import torch

from phalanx.binding import allowed_cores, check_bindable, place_worker
from phalanx.comm.board import attach_board, board_memory, mark_exit, open_board
from phalanx.comm.shm import remove_segments_of
from phalanx.devices import DevicePlan
from phalanx.errors import RunFailed, UsageError
from phalanx.lifeline import describe_signal, die_with_parent, stop_on_signals, terminate
from phalanx.world import World, launcher_env, start_world, stop_world

# glibc reads these at process start: keep large blocks on the heap instead of mmap/munmap per step.
CPU_ALLOCATOR_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
# After a first failure, keep listening this long for the other ranks' reports: the first one to
# arrive is often a secondary "connection closed" from a peer of the rank that really broke.
ERROR_GRACE_S = 1.0


# Set in a spawned worker: (shared array of every rank's last finished step, this rank).
_PROGRESS: tuple[Any, int] | None = None


def report_progress(step: int) -> None:
    """Record the global step this worker just finished, so a failure report can name it.

    A no-op outside a local spawned run (one device, torchrun): there nobody collects it."""
    if _PROGRESS is not None:
        _PROGRESS[0][_PROGRESS[1]] = step


class WorkerFailed(RuntimeError):
    """A worker raised, died or hung; line one names the rank, then every report collected."""


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    plan: DevicePlan
    threads_per_device: int | None = None  # CPU threads per worker; None = cores / local workers
    timeout_s: float = 120.0  # bound on every collective (the process group's timeout)
    # Bound on the whole spawned run, teardown included. None for training, which relies on
    # timeout_s; tests set it so a hung worker fails in seconds. Not enforced in-process/torchrun.
    deadline_s: float | None = None
    # One device: run fn in this process (False) or spawn one worker like k > 1 (True: a fresh
    # process with the CPU allocator setting, for timings comparable with k-device runs).
    spawn_single: bool = False
    # Pin each local worker to its own equal slice of the cores (binding.py); opt-in.
    bind_cores: bool = False

    def __post_init__(self) -> None:
        if self.threads_per_device is not None and self.threads_per_device < 1:
            raise ValueError(f"threads_per_device {self.threads_per_device} must be at least 1")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s {self.timeout_s} must be a positive number of seconds")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ValueError(f"deadline_s {self.deadline_s} must be positive seconds or None")


def launch(fn: Callable[..., Any], *args: Any, spec: LaunchSpec) -> list[Any]:
    """Run `fn(world, *args)` on every device of the plan; return the results by rank.

    Spawned workers must get a module-level `fn` (spawn pickles it by name) and return something
    picklable. A worker's `UsageError` is raised here as `UsageError`; any other failure as
    `WorkerFailed`. Under torchrun only this process's result is returned (a list of one); with
    one device `fn` runs in this process and its exceptions propagate unchanged.
    """
    env = launcher_env()
    if env is not None:
        device = torch.device(f"cuda:{env.local_rank}") if spec.plan.kind == "cuda" else torch.device("cpu")
        _place(device, spec, env.local_rank, env.local_world_size)
        world = start_world(rank=env.rank, world_size=env.world_size, local_rank=env.local_rank,
                            local_world_size=env.local_world_size, device=device,
                            master_addr=env.master_addr, master_port=env.master_port, timeout_s=spec.timeout_s,
                            from_launcher_env=True)
        try:
            world = open_board(world)  # the collective board (issue 21/22): torchrun has no launcher to hold one
            result = fn(world, *args)
            mark_exit(world, ok=True)
            return [result]
        except BaseException:
            mark_exit(world, ok=False)
            raise
        finally:
            stop_world(world)
    if spec.bind_cores:  # refuse before any worker starts, not in each of them
        check_bindable(spec.plan.num_devices, len(allowed_cores()))
    if spec.plan.num_devices == 1 and not spec.spawn_single:
        device = spec.plan.torch_device(0)
        _place(device, replace(spec, bind_cores=False), 0, 1)  # alone in this process: all of its cores
        world = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=device,
                      backend="none", timeout_s=spec.timeout_s)
        return [fn(world, *args)]
    return _spawn(fn, args, spec)


def _place(device: torch.device, spec: LaunchSpec, local_rank: int, local_world_size: int) -> None:
    if device.type == "cpu" or spec.bind_cores:
        place_worker(local_rank, local_world_size, bind_cores=spec.bind_cores, threads=spec.threads_per_device,
                     cpu=device.type == "cpu")


def loopback_interface() -> str | None:
    """The loopback interface's name ("lo" on Linux, "lo0" on macOS), or None if none is found."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in names if n in ("lo", "lo0")), next((n for n in names if n.startswith("lo")), None))


def _pin_to_loopback(env: dict[str, str]) -> dict[str, str]:
    """GLOO/NCCL socket interface settings for a local run (a user's own setting wins)."""
    name = loopback_interface()
    if name is None:
        return {}
    return {key: name for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if key not in env}


def _worker_main(rank: int, fn, args, spec: LaunchSpec, store_path: str, conn, progress=None,
                 parent_pid: int | None = None, board=None) -> None:
    """One spawned worker: join the world, run fn, send one report, then leave the world."""
    global _PROGRESS
    if parent_pid is not None:
        die_with_parent(parent_pid)
    _PROGRESS = None if progress is None else (progress, rank)
    world, exit_code = None, 0
    try:
        device = spec.plan.torch_device(rank)
        _place(device, spec, rank, spec.plan.num_devices)
        world = start_world(rank=rank, world_size=spec.plan.num_devices, local_rank=rank,
                            local_world_size=spec.plan.num_devices, device=device,
                            master_addr="127.0.0.1", master_port=0, timeout_s=spec.timeout_s,
                            store_path=store_path)
        world = attach_board(world, board)  # where each rank says which collective it is in (comm/board.py)
        # Pickle here, not in a queue's feeder thread, so an unpicklable result is reported as
        # this worker's error instead of being lost; plain pickle copies tensor data into the
        # bytes (no shared-memory handles that would die with this process).
        report = pickle.dumps(("ok", fn(world, *args)))
        mark_exit(world, ok=True)  # peers still waiting in a collective are told it ended normally
    except UsageError as exc:
        report, exit_code = pickle.dumps(("usage", str(exc))), 2
    except RunFailed as exc:  # a checked condition: the message is the whole story
        report, exit_code = pickle.dumps(("failed", str(exc).splitlines()[0], "")), 1
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        summary = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
        report, exit_code = pickle.dumps(("error", summary, traceback.format_exc())), 1
    if exit_code:
        mark_exit(world, ok=False)
    try:
        # Deliver before teardown: send_bytes returns once the whole report is in the pipe, so an
        # abort inside destroy_process_group or at interpreter exit can no longer lose it.
        conn.send_bytes(report)
        conn.close()
    except OSError:
        pass  # the parent is gone (interrupted): nobody is left to tell
    try:
        stop_world(world)
    finally:
        if exit_code:
            raise SystemExit(exit_code)


def _spawn(fn, args, spec: LaunchSpec) -> list[Any]:
    ctx = mp.get_context("spawn")
    rendezvous_dir = tempfile.mkdtemp(prefix="phalanx-rendezvous-")  # mode 0700: this user's alone
    store_path = os.path.join(rendezvous_dir, "store")
    extra_env = dict(CPU_ALLOCATOR_ENV) if spec.plan.kind == "cpu" else {}
    extra_env.update(_pin_to_loopback(dict(os.environ)))
    saved = {k: os.environ.get(k) for k in extra_env}
    procs, conns = [], []
    progress = ctx.Array("q", [-1] * spec.plan.num_devices, lock=False)  # last finished step per rank
    board = board_memory(ctx, spec.plan.num_devices)  # the workers' collective board
    try:
        try:
            for key, value in extra_env.items():
                os.environ.setdefault(key, value)  # a user's own setting wins
            for rank in range(spec.plan.num_devices):
                parent_end, child_end = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_worker_main, name=f"phalanx-worker-{rank}",
                                   args=(rank, fn, args, spec, store_path, child_end, progress, os.getpid(), board))
                proc.start()
                child_end.close()  # keep only the child's copy, so its death reads as EOF here
                procs.append(proc)
                conns.append(parent_end)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        with stop_on_signals():
            return _supervise(procs, conns, spec, progress=progress)
    finally:  # failure, deadline, KeyboardInterrupt, SIGTERM: take every child down and reap it
        terminate(procs)
        for conn in conns:
            conn.close()
        shutil.rmtree(rendezvous_dir, ignore_errors=True)
        # A worker killed between creating its shm segment and every rank mapping it (a few ms
        # at start) leaves the file behind; it is named after that worker's pid.
        remove_segments_of([proc.pid for proc in procs if proc.pid is not None])


def _supervise(procs, conns, spec: LaunchSpec, progress=None) -> list[Any]:
    deadline = None if spec.deadline_s is None else time.monotonic() + spec.deadline_s
    reports: dict[int, tuple] = {}  # rank -> ("ok", result) | ("usage", msg) | ("error", line, tb)
    first_failure: int | None = None
    give_up_at = deadline
    pending = set(range(len(procs)))
    while pending:
        timeout = None if give_up_at is None else give_up_at - time.monotonic()
        if timeout is not None and timeout <= 0:
            break
        # Sentinels too: a worker whose pipe a forked grandchild still holds open gives no EOF.
        ready = set(wait([conns[r] for r in pending] + [procs[r].sentinel for r in pending], timeout))
        for rank in sorted(r for r in pending if conns[r] in ready or procs[r].sentinel in ready):
            report = _read_report(procs[rank], conns[rank])
            pending.discard(rank)
            reports[rank] = report
            if report[0] != "ok" and first_failure is None:
                first_failure = rank
                grace_end = time.monotonic() + ERROR_GRACE_S
                give_up_at = grace_end if give_up_at is None else min(give_up_at, grace_end)
    if first_failure is None and pending:
        first_failure = min(pending)
        for rank in sorted(pending):
            reports[rank] = ("error", f"gave no result within the {spec.deadline_s:g} s deadline (hung?)", "")
    if first_failure is None:
        _await_exit(procs, reports, deadline or time.monotonic() + spec.timeout_s)
        first_failure = next((r for r in sorted(reports) if reports[r][0] != "ok"), None)
    if first_failure is None:
        return [reports[rank][1] for rank in range(len(procs))]
    usage = [report[1] for _, report in sorted(reports.items()) if report[0] == "usage"]
    if usage:  # bad input is the user's to fix: one line, whatever the other ranks then hit
        raise UsageError(usage[0])
    checked = [report[1] for _, report in sorted(reports.items()) if report[0] == "failed"]
    if checked:  # every rank checks the same gathered values: one line says it all
        raise WorkerFailed(f"run stopped: {checked[0]}")
    failed = {rank: report for rank, report in sorted(reports.items()) if report[0] != "ok"}
    # The root cause first: a rank that died (signal, exit without a report) explains its peers'
    # "connection closed" errors, even when one of those reached us first.
    died = [rank for rank, report in failed.items() if report[1].startswith(("died", "exited with code"))]
    if died:
        first_failure = died[0]
    if progress is not None and progress[first_failure] >= 0:
        reports[first_failure] = (reports[first_failure][0],
                                  f"{reports[first_failure][1]} after step {progress[first_failure]}",
                                  *reports[first_failure][2:])
    sections = [f"--- rank {rank} ---\n{(report[2] or report[1]).rstrip()}" for rank, report in failed.items()]
    raise WorkerFailed(f"worker rank {first_failure} failed: {reports[first_failure][1]}\n" + "\n".join(sections))


def _read_report(proc, conn) -> tuple:
    """This worker's report, or a report of its death (all it sent is in the pipe once it exits)."""
    try:
        if conn.poll(0):
            return pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        pass  # the pipe closed without a report: the worker is dead, or about to be
    except Exception as exc:  # noqa: BLE001 - a result this process cannot unpickle
        return ("error", f"result could not be unpickled: {type(exc).__name__}: {exc}", traceback.format_exc())
    proc.join(1)
    if proc.exitcode is None:
        return ("error", "closed its result pipe but kept running", "")
    if proc.exitcode < 0:
        return ("error", f"died ({describe_signal(-proc.exitcode)})", "")
    return ("error", f"exited with code {proc.exitcode} without a result", "")


def _await_exit(procs, reports: dict, deadline: float) -> None:
    """Every result is in: judge how each worker then exited (SIGABRT here is gloo's, tolerated)."""
    for rank, proc in enumerate(procs):
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.exitcode is None:
            reports[rank] = ("error", "delivered its result but did not exit in time (hung in teardown?)", "")
        elif proc.exitcode == -signal.SIGABRT:
            warnings.warn(f"worker rank {rank} aborted (SIGABRT) after delivering its result: "
                          "the known gloo exit-time abort; its result is kept")
        elif proc.exitcode != 0:
            reports[rank] = ("error", f"delivered its result but then exited with code {proc.exitcode}", "")


