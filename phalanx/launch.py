"""Start the workers of a run: spawn k local processes, or join a job torchrun already started.

A local run spawns one process per device (fresh interpreters, `spawn`), rendezvous on
127.0.0.1 at a free port, and supervises them: the first worker that fails takes the others
down with it (no orphans, no hang), and its message reaches the user. A worker reports its
result *before* leaving the process group, so the rare gloo abort at process exit (BASELINES.md:
~1 in 80 runs, SIGABRT after destroy_process_group) cannot turn a finished run into a failure.
CPU workers get `cores / k` threads and an allocator setting that keeps freed activations
mapped (BASELINES.md: page faults cost 6-13% of a batch-256 step, up to 1.5x at batch 1024).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import queue as queue_module
import signal
import socket
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch

from phalanx.devices import DevicePlan
from phalanx.errors import UsageError
from phalanx.world import World, launcher_env, start_world, stop_world

# glibc reads these at process start: keep large blocks on the heap instead of mmap/munmap per step.
CPU_ALLOCATOR_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


class WorkerFailed(RuntimeError):
    """A worker process failed; the message names the rank and what happened."""


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    plan: DevicePlan
    threads_per_device: int | None = None
    timeout_s: float = 120.0


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_threads(local_workers: int) -> int:
    return max(1, available_cores() // max(1, local_workers))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def launch(fn: Callable[..., Any], *args: Any, spec: LaunchSpec) -> list[Any]:
    """Run `fn(world, *args)` on every device of the plan; return the results by rank.

    Under torchrun only this process's result is returned (a list of one).
    """
    env = launcher_env()
    if env is not None:
        device = torch.device(f"cuda:{env.local_rank}") if spec.plan.kind == "cuda" else torch.device("cpu")
        _set_threads(device, spec.threads_per_device or default_threads(env.local_world_size))
        world = start_world(
            rank=env.rank,
            world_size=env.world_size,
            local_rank=env.local_rank,
            local_world_size=env.local_world_size,
            device=device,
            master_addr=env.master_addr,
            master_port=env.master_port,
            timeout_s=spec.timeout_s,
        )
        try:
            return [fn(world, *args)]
        finally:
            stop_world(world)
    if spec.plan.num_devices == 1:
        device = spec.plan.torch_device(0)
        _set_threads(device, spec.threads_per_device or default_threads(1))
        world = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=device,
                      backend="none", timeout_s=spec.timeout_s)
        return [fn(world, *args)]
    return _spawn(fn, args, spec)


def _set_threads(device: torch.device, threads: int) -> None:
    if device.type == "cpu":
        torch.set_num_threads(threads)


def _worker_main(rank: int, fn, args, spec: LaunchSpec, port: int, results) -> None:
    world = None
    try:
        device = spec.plan.torch_device(rank)
        _set_threads(device, spec.threads_per_device or default_threads(spec.plan.num_devices))
        world = start_world(
            rank=rank,
            world_size=spec.plan.num_devices,
            local_rank=rank,
            local_world_size=spec.plan.num_devices,
            device=device,
            master_addr="127.0.0.1",
            master_port=port,
            timeout_s=spec.timeout_s,
        )
        result = fn(world, *args)
        results.put(("ok", rank, result))
        # Flush the result into the pipe now, before teardown, which is where gloo may abort.
        results.close()
        results.join_thread()
    except UsageError as exc:
        results.put(("usage", rank, str(exc)))
        raise SystemExit(2)
    except KeyboardInterrupt:
        raise SystemExit(130)
    except BaseException as exc:  # report, then die non-zero: the parent stops the others
        results.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(1)
    finally:
        stop_world(world)


def _spawn(fn, args, spec: LaunchSpec) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    extra_env = dict(CPU_ALLOCATOR_ENV) if spec.plan.kind == "cpu" else {}
    saved = {k: os.environ.get(k) for k in extra_env}
    procs = []
    try:
        for key, value in extra_env.items():
            os.environ.setdefault(key, value)  # a user's own setting wins
        for rank in range(spec.plan.num_devices):
            proc = ctx.Process(target=_worker_main, args=(rank, fn, args, spec, port, results), daemon=False)
            proc.start()
            procs.append(proc)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        return _supervise(procs, results)
    finally:
        _terminate(procs)


def _supervise(procs, results) -> list[Any]:
    outcome: dict[int, tuple[str, Any]] = {}
    while True:
        _drain(results, outcome)
        alive = [p for p in procs if p.exitcode is None]
        for rank, proc in enumerate(procs):
            code = proc.exitcode
            if code is None or code == 0:
                continue
            _drain(results, outcome)
            status = outcome.get(rank, (None, None))
            if status[0] == "ok" and code == -signal.SIGABRT:
                continue  # finished, then hit the known exit-time gloo abort: the work is done
            _terminate(procs)
            _drain(results, outcome)
            usage = [msg for kind, msg in outcome.values() if kind == "usage"]
            if usage:
                raise UsageError(usage[0])
            errors = [(r, msg) for r, (kind, msg) in sorted(outcome.items()) if kind == "error"]
            if errors:
                first_rank, message = errors[0]
                raise WorkerFailed(f"worker rank {first_rank} failed: {message}")
            raise WorkerFailed(f"worker rank {rank} died ({_describe_exit(code)}) before finishing")
        if not alive:
            break
        mp.connection.wait([p.sentinel for p in alive], timeout=0.5)
    _drain(results, outcome)
    missing = [r for r in range(len(procs)) if outcome.get(r, (None,))[0] != "ok"]
    if missing:
        raise WorkerFailed(f"worker rank {missing[0]} exited without reporting a result")
    return [outcome[r][1] for r in range(len(procs))]


def _drain(results, outcome: dict) -> None:
    while True:
        try:
            kind, rank, payload = results.get_nowait()
        except queue_module.Empty:
            return
        outcome[rank] = (kind, payload)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _terminate(procs, grace_s: float = 5.0) -> None:
    for proc in procs:
        if proc.exitcode is None:
            proc.terminate()
    for proc in procs:
        proc.join(timeout=grace_s)
        if proc.exitcode is None:
            proc.kill()
            proc.join(timeout=grace_s)
