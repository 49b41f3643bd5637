"""Start the workers of a run: spawn k local processes, or join a job torchrun already started.

A local run is a one-host torchrun job whose agent is this launcher: it hosts the job's store
(a c10d TCPStore on a socket it bound to 127.0.0.1, so nothing listens on another interface and
no port can be taken between choosing and binding it; gloo's and NCCL's own sockets are pinned
to the loopback interface too) and spawns one process per device with torchrun's environment
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...: `torchrun_env`). Every worker then joins
the way a torchrun worker does (`join_launcher_world`, the one torchrun join), and a user's
script that calls `init_process_group` itself (env://) finds the same store. phalanx.runtime.supervise
runs and watches the processes (one report each, the first failure takes every worker down,
teardown bounded on its own). CPU workers get `cores / k` threads (with `bind_cores`, each its
own slice of the cores) and the allocator setting of binding.keep_freed_memory_mapped.
The distributed tests start their workers through this same code (tests/distributed/harness.py).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
import socket
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from phalanx.runtime.child_world import JOINED_PID
from phalanx.runtime.binding import (allowed_cores, check_bindable, oversubscription, place_worker, too_many_workers,
                                    worker_threads)
from phalanx.errors import UsageError
from phalanx.runtime.board import mark_exit, open_board
from phalanx.runtime.devices import DevicePlan
from phalanx.runtime.fork_server import FRESH
from phalanx.runtime.host_limits import check_limits, check_temp_dir
from phalanx.runtime.lifeline import signals_deferred, stop_on_signals
from phalanx.runtime.progress import report_progress
from phalanx.runtime.supervise import TEARDOWN_S, WorkerSet, run_workers
from phalanx.runtime.worker_errors import WorkerFailed
from phalanx.runtime.slurm import alone_in_slurm_step
from phalanx.runtime.world import LauncherEnv, World, launcher_env, start_world, stop_world

__all__ = ["LaunchSpec", "WorkerFailed", "join_launcher_world", "launch", "report_progress", "setup_worker",
           "spawn_workers", "threads_per_worker", "torchrun_device", "torchrun_env"]


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    plan: DevicePlan
    threads_per_device: int | None = None  # CPU threads per worker; None = cores / local workers
    timeout_s: float = 120.0  # bound on every collective (the process group's timeout)
    # Bound on the spawned workers' results arriving. None for training, which relies on
    # timeout_s; tests set it so a hung worker fails in seconds. Not enforced in-process/torchrun.
    deadline_s: float | None = None
    # How long finished workers may take to exit before they are killed (their results stand).
    teardown_s: float = TEARDOWN_S
    # One device: run fn in this process (False) or spawn one worker like k > 1 (True: a fresh
    # process set up as k > 1 workers are, for timings comparable with k-device runs).
    spawn_single: bool = False
    # Pin each local worker to its own equal slice of the cores (runtime/binding.py); opt-in.
    bind_cores: bool = False

    def __post_init__(self) -> None:
        if self.threads_per_device is not None and self.threads_per_device < 1:
            raise ValueError(f"threads_per_device {self.threads_per_device} must be at least 1")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s {self.timeout_s} must be a positive number of seconds")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ValueError(f"deadline_s {self.deadline_s} must be positive seconds or None")
        if not self.teardown_s > 0:
            raise ValueError(f"teardown_s {self.teardown_s} must be positive seconds")


def launch(fn: Callable[..., Any], *args: Any, spec: LaunchSpec) -> list[Any]:
    """Run `fn(world, *args)` on every device of the plan; return the results by rank.

    Spawned workers must get a module-level `fn` (spawn pickles it by name) and return something
    picklable. A worker's `UsageError` is raised here as `UsageError`; any other failure as
    `WorkerFailed`. Under torchrun only this process's result is returned (a list of one); with
    one device `fn` runs in this process and its exceptions propagate unchanged.
    """
    env = launcher_env()
    if env is not None:
        if env.local_rank == 0:
            warn_if_oversubscribed(spec, local_workers=env.local_world_size)
        world = join_launcher_world(env, device=torchrun_device(spec, env), timeout_s=spec.timeout_s,
                                    threads=spec.threads_per_device, bind_cores=spec.bind_cores)
        try:
            return [_run_on_board(world, fn, args)]
        finally:
            stop_world(world)
    alone_in_slurm_step()
    if spec.plan.num_devices == 1 and not spec.spawn_single:
        warn_if_oversubscribed(spec, local_workers=1)
        device = spec.plan.torch_device(0)
        setup_worker(device, local_rank=0, local_world_size=1, threads=spec.threads_per_device,
                     bind_cores=False)  # alone in this process: all of its cores
        return [fn(World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=device, backend="none",
                         timeout_s=spec.timeout_s), *args)]
    return spawn_workers(_world_body, (fn, args, spec), spec=spec)


def join_launcher_world(env: LauncherEnv, *, device: torch.device, timeout_s: float, threads: int | None = None,
                        bind_cores: bool = False, set_up: bool = True) -> World:
    """The one torchrun join: set this worker up (`setup_worker`) and join the job's process group
    through its store. Serves torchrun's workers, phalanx's own spawned workers and
    `phalanx.init()`; `set_up=False` where the caller has set the worker up already."""
    if set_up:
        setup_worker(device, local_rank=env.local_rank, local_world_size=env.local_world_size, threads=threads,
                     bind_cores=bind_cores)
    return start_world(rank=env.rank, world_size=env.world_size, local_rank=env.local_rank,
                       local_world_size=env.local_world_size, device=device, master_addr=env.master_addr,
                       master_port=env.master_port, timeout_s=timeout_s, node_rank=env.node_rank,
                       from_launcher_env=True)


def spawn_workers(body: Callable[[int, Any, contextlib.ExitStack], Any], payload: Any, *, spec: LaunchSpec,
                  exit_zero_is_success: bool = False, announce: Callable[[str], None] | None = None,
                  start_method: str = FRESH, restart_count: int = 0, max_restarts: int = 0,
                  for_launch: bool = False) -> list[Any]:
    """Spawn one process per device of the plan with torchrun's environment, this launcher hosting
    the store; each runs `body(rank, payload, teardown)` (see phalanx.runtime.supervise; `start_method`
    FRESH: each a process that ran nothing yet, from the fork server or spawned: runtime/fork_server.py;
    "spawn" always a new interpreter; "fork" a copy of this process: runtime/forked.py; `restart_count`
    of `max_restarts`: which attempt this is, as torchrun tells its workers: runtime/restarts.py; `for_launch`: warnings
    name phalanx.launch's keywords).
    `announce(store_address)` is called once the store listens, before any worker starts."""
    if spec.bind_cores:  # refuse before any worker starts, not in each of them
        check_bindable(spec.plan.num_devices, len(allowed_cores()))
    k = spec.plan.num_devices
    check_limits(k)
    check_temp_dir()
    with stop_on_signals(), loopback_store(k, timeout_s=spec.timeout_s) as port:
        if announce is not None:
            announce(f"127.0.0.1:{port}")
        warn_if_oversubscribed(spec, local_workers=k, for_launch=for_launch)
        run_id = f"phalanx-{os.getpid()}-{secrets.token_hex(4)}"
        envs = [torchrun_env(rank=rank, world_size=k, master_port=port, run_id=run_id, restart_count=restart_count,
                             max_restarts=max_restarts) for rank in range(k)]
        return run_workers(WorkerSet(body=body, payload=payload, num_procs=k, env=envs, deadline_s=spec.deadline_s,
                                     teardown_s=spec.teardown_s, exit_zero_is_success=exit_zero_is_success,
                                     start_method=start_method))


def torchrun_env(*, rank: int, world_size: int, master_port: int, run_id: str, restart_count: int = 0,
                 max_restarts: int = 0) -> dict[str, str]:
    """What torchrun's agent puts in a worker's environment (torch.distributed.elastic's
    LocalElasticAgent), for local rank `rank` of a one-host job whose agent hosts the store on
    127.0.0.1:`master_port`; plus the loopback pins for gloo and NCCL (a user's own setting wins).
    The rest of torchrun's contract is made where phalanx makes it: each worker's error file by
    the supervisor (TORCHELASTIC_ERROR_FILE), its threads by binding.place_worker (OMP_NUM_THREADS,
    MKL_NUM_THREADS), its script's absolute `__file__` by script.py."""
    env = {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_NAME": "default",
        "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # every rank connects to our store; none hosts one
        # What torchrun's agent sets in its own environment (the signals it forwards), so its workers have it too.
        "TORCHELASTIC_SIGNALS_TO_HANDLE": os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE",
                                                         "SIGTERM,SIGINT,SIGHUP,SIGQUIT"),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        JOINED_PID: "",  # a worker, never a joined worker's descendant, whatever stamp the launcher inherited
    }
    interface = loopback_interface()
    for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if interface is not None and key not in os.environ:
            env[key] = interface
    return env


@contextlib.contextmanager
def loopback_store(world_size: int, *, timeout_s: float) -> Iterator[int]:
    """Host a c10d TCPStore for the run on 127.0.0.1; yield its port.

    TCPStore would listen on every interface; handed a socket already bound to 127.0.0.1 (the
    store then owns and closes it) it listens there alone. The launcher outlives every worker, so
    the store survives any of them dying (a rank-0-hosted store would not)."""
    check_loopback()
    with signals_deferred():  # a stop lands once the store is ours to close
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("127.0.0.1", 0))
            sock.listen(max(128, world_size))
            port = sock.getsockname()[1]
        except BaseException:
            sock.close()
            raise
        # From here the descriptor is the store's: it closes it, also when its constructor fails
        # (closing it again here would raise EBADF over the store's own error).
        fd = sock.detach()
        store = _store_on(fd, port, world_size, timeout_s=timeout_s)
    try:
        yield port
    finally:
        with signals_deferred():
            del store


# A connection to our own listening socket is made (or refused) at once when loopback works;
# the bound is for a firewall that drops packets silently rather than refusing them.
LOOPBACK_CHECK_S = 5.0


def check_loopback(*, timeout_s: float = LOOPBACK_CHECK_S) -> None:
    """Refuse in one line, at once, a host where this process cannot connect to a socket of its own
    on 127.0.0.1 (a network namespace or container whose lo is down: `unshare -n`), where the
    store's clients would retry until the store's timeout and then fail in a c10d traceback. A
    throwaway listener, so the store never accepts the probe's connection."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            with socket.create_connection(listener.getsockname(), timeout=timeout_s):
                pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UsageError(f"cannot reach 127.0.0.1 ({reason}): the loopback interface is down in this network "
                         "namespace or container, and the workers meet there; bring it up (ip link set lo up) "
                         "or run where it is up") from None


def _store_on(fd: int, port: int, world_size: int, *, timeout_s: float) -> dist.TCPStore:
    """A master TCPStore listening on the socket `fd`. torch's libuv store (the default since 2.4) takes a
    listening socket only from 2.8 on (pytorch#150215); before, its legacy store does."""
    kwargs = dict(is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s),
                  master_listen_fd=fd)
    if torch.__version__ >= (2, 8):  # TorchVersion compares with a tuple
        try:
            return dist.TCPStore("127.0.0.1", port, world_size, **kwargs)
        except NotImplementedError:  # a build whose libuv store still lacks it
            pass
    return dist.TCPStore("127.0.0.1", port, world_size, use_libuv=False, **kwargs)


def _world_body(rank: int, payload, teardown: contextlib.ExitStack) -> Any:
    """A spawned worker of `launch`: join the world as a torchrun worker would, run fn."""
    fn, args, spec = payload
    world = join_launcher_world(launcher_env(), device=spec.plan.torch_device(rank), timeout_s=spec.timeout_s,
                                threads=spec.threads_per_device, bind_cores=spec.bind_cores)
    teardown.callback(stop_world, world)
    return _run_on_board(world, fn, args)


def _run_on_board(world: World, fn: Callable[..., Any], args: tuple) -> Any:
    """`fn(world, *args)` with the collective board open (runtime/board.py: a collective, right after
    joining), and this rank's line saying how its work ended, so peers still waiting in a
    collective learn it at once (a rank that finished early, or failed) instead of at the timeout."""
    world = open_board(world)
    try:
        result = fn(world, *args)
    except BaseException:
        mark_exit(world, ok=False)
        raise
    mark_exit(world, ok=True)
    return result


def torchrun_device(spec: LaunchSpec, env: LauncherEnv) -> torch.device:
    """The device a torchrun worker drives: cuda:LOCAL_RANK for a CUDA plan, else the CPU."""
    return torch.device(f"cuda:{env.local_rank}") if spec.plan.kind == "cuda" else torch.device("cpu")


def setup_worker(device: torch.device, *, local_rank: int, local_world_size: int, threads: int | None,
                 bind_cores: bool) -> None:
    """Cores, threads and the allocator setting of one worker (binding.place_worker) for its device."""
    if device.type == "cpu" or bind_cores:
        place_worker(local_rank, local_world_size, bind_cores=bind_cores, threads=threads, cpu=device.type == "cpu")


def threads_per_worker(spec: LaunchSpec, *, local_workers: int) -> int | None:
    """The intra-op threads each CPU worker of this host gets (binding.worker_threads); None for
    a CUDA plan, whose workers keep torch's own count."""
    if spec.plan.kind != "cpu":
        return None
    return worker_threads(local_workers, bind_cores=spec.bind_cores, threads=spec.threads_per_device)


def warn_if_oversubscribed(spec: LaunchSpec, *, local_workers: int, for_launch: bool = False) -> None:
    """One line on stderr when this host's CPU workers x their threads exceed its cores: too many
    threads each (--threads-per-device), or more workers than cores. `for_launch`: said as
    phalanx.launch's, naming its keyword (threads_per_device=)."""
    threads = threads_per_worker(spec, local_workers=local_workers)
    if threads is None:
        return
    message = oversubscription(threads, local_workers) or too_many_workers(local_workers)
    if message is None:
        return
    if for_launch:
        message = message.replace("--threads-per-device ", "threads_per_device=")
    print(f"{'phalanx.launch' if for_launch else 'phalanx'}: warning: {message}", file=sys.stderr, flush=True)


def loopback_interface() -> str | None:
    """The loopback interface's name ("lo" on Linux, "lo0" on macOS), or None if none is found."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in names if n in ("lo", "lo0")), next((n for n in names if n.startswith("lo")), None))
