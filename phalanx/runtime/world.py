"""The distributed state of one worker process: who it is, which device it drives, how it talks.

`World` is the one object that carries rank, world size and device; it is passed by keyword to
everything that communicates (no module globals). This module is also the only reader of the
launcher's environment variables (RANK, WORLD_SIZE, LOCAL_RANK, ... as set by torchrun or by
`phalanx.runtime.launch`). A world of size 1 opens no process group: every collective is then a no-op.
"""

from __future__ import annotations

import builtins
import datetime
import os
import socket
from dataclasses import dataclass, field
from typing import Mapping

import torch
import torch.distributed as dist

from phalanx.errors import UsageError
from phalanx.runtime.foreign_names import foreign_name_error
from phalanx.runtime.fork_guard import guard_forks
from phalanx.runtime.join import attempt_prefix, wait_for_peers

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT")
# "1" makes every CUDA rank of this host drive cuda:0 and the ranks talk over gloo: a k-GPU run
# rehearsed on a machine with one GPU (docs/command.md, Environment; tests/gpu run this way).
# NCCL refuses two ranks on one GPU; gloo's collectives take CUDA tensors (copied through host
# memory), its point-to-point ops do not (DataParallel refuses ring/tree/naive there).
RANKS_SHARE_GPU_VAR = "PHALANX_RANKS_SHARE_GPU"


@dataclass(frozen=True, kw_only=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str  # "gloo" (CPU) or "nccl" (CUDA); "none" when world_size == 1
    timeout_s: float
    # Which host this rank runs on, as the launcher numbers them (torchrun's GROUP_RANK, its node
    # rank): ranks of one node_rank share a host and its memory. Never the hostname, so hosts
    # simulated on one machine behave as real ones.
    node_rank: int = 0
    # Workers per node, by node rank, where the ranks span nodes under torchrun (start_world
    # gathers them); None elsewhere. What a node's own LOCAL_WORLD_SIZE cannot say: whether the
    # others run as many, so that every rank picks the same allreduce (comm/hosts.py).
    node_sizes: tuple[int, ...] | None = None
    # The collective board (phalanx.runtime.board.Board) this rank shares with its local peers, or
    # None: what lets a wait name the rank and the collective at fault. Set by the launcher.
    board: object | None = field(default=None, compare=False, repr=False)
    # The process that made this world (`check_here`); `dataclasses.replace` keeps it.
    pid: int = field(default_factory=os.getpid, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of size {self.world_size}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(f"local_rank {self.local_rank} outside local world {self.local_world_size}")
        if self.node_rank < 0:
            raise ValueError(f"node_rank {self.node_rank} must be >= 0")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def check_here(self, what: str) -> None:
        """Refuse a world another process made: a function phalanx.launch forked onto its workers
        keeps what it captured from the launching process (a notebook's `world = phalanx.init()`,
        a world of one), and with it each worker would train alone, silently."""
        if self.pid != os.getpid():
            raise UsageError(f"{what} uses a world made in another process (pid {self.pid}; this is {os.getpid()}), a "
                             f"world of {self.world_size} that is not this worker's: one from before phalanx.launch "
                             "forked this worker (the notebook's phalanx.init()) trains alone in every worker; call "
                             "phalanx.init() inside the function and pass the world it returns (to prepare, "
                             "ShardedLoader and every collective)")

    def print(self, *args, **kwargs) -> None:
        """`print` on rank 0 only, flushed (k workers share one terminal); other ranks print nothing."""
        if self.is_main:
            builtins.print(*args, **{"flush": True, **kwargs})

    def __deepcopy__(self, memo: dict) -> "World":
        """The world itself: this process's place among the ranks, not a value (its board maps shared
        memory), so a copied model that holds it (a SyncBatchNorm in an EMA or teacher copy) shares it."""
        return self

    def __getattr__(self, name: str):
        """Only for a name World does not have: Accelerate's or Fabric's spelling gets phalanx's
        way in the error (foreign_names.py)."""
        raise foreign_name_error(name)


@dataclass(frozen=True, kw_only=True)
class LauncherEnv:
    """What an external launcher (torchrun) told this process through its environment."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    node_rank: int = 0  # GROUP_RANK: torchrun's node rank (0 on a one-host launch)
    restart_count: int = 0  # torchrun --max-restarts: how many times this job was restarted


def launcher_env(environ: Mapping[str, str] | None = None) -> LauncherEnv | None:
    """Read torchrun-style variables; None when this process was not started by a launcher."""
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        world_size = int(env["WORLD_SIZE"])
        return LauncherEnv(
            rank=int(env["RANK"]),
            world_size=world_size,
            local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world_size)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
            node_rank=int(env.get("GROUP_RANK", "0")),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        )
    except ValueError as exc:
        raise UsageError(f"launcher environment is malformed ({exc}); fix RANK/WORLD_SIZE/LOCAL_RANK") from None


def open_group_env() -> LauncherEnv:
    """What a launcher would have said, for a default process group the script opened itself with
    no launcher's environment (torch.multiprocessing.spawn, then init_process_group with a rank of
    its own): rank and size from the group; which ranks share a host from their hostnames, the one
    place phalanx compares them, since nothing else says so here (a collective, over gloo)."""
    rank, mine = dist.get_rank(), socket.gethostname()
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    hosts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, mine, group=group)
    if group is not None:
        dist.destroy_process_group(group)
    local = [r for r, host in enumerate(hosts) if host == mine]
    port = os.environ.get("MASTER_PORT", "")
    return LauncherEnv(rank=rank, world_size=len(hosts), local_rank=local.index(rank), local_world_size=len(local),
                       master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                       master_port=int(port) if port.isdigit() else 29500,
                       node_rank=list(dict.fromkeys(hosts)).index(mine))


def ranks_share_gpu(environ: Mapping[str, str] | None = None) -> bool:
    """True when RANKS_SHARE_GPU_VAR asks every CUDA rank onto cuda:0 over gloo."""
    value = (os.environ if environ is None else environ).get(RANKS_SHARE_GPU_VAR, "")
    if value not in ("", "0", "1"):
        raise UsageError(f"{RANKS_SHARE_GPU_VAR}={value!r} is not understood; set it to 1 (ranks share cuda:0 over "
                         "gloo) or unset it")
    return value == "1"


def start_world(
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    device: torch.device,
    master_addr: str,
    master_port: int,
    timeout_s: float,
    node_rank: int = 0,
    from_launcher_env: bool = False,
) -> World:
    """Join the process group (TCP store rendezvous at master_addr:master_port) and pin the device.

    `timeout_s` bounds every collective and point-to-point wait: a lost peer fails the run
    instead of hanging it. Under torchrun (`from_launcher_env`) see `_launcher_store`.
    """
    backend = "none"
    shared_gpu = device.type == "cuda" and ranks_share_gpu()
    if shared_gpu:
        device = torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1:
        backend = "nccl" if device.type == "cuda" and not shared_gpu else "gloo"
        _import_group_defaults()
        guard_forks()  # gloo's threads make Python thread states: fork_guard.py
        if from_launcher_env:
            rendezvous = {"store": _launcher_store(master_addr, master_port, rank=rank, world_size=world_size,
                                                    timeout_s=timeout_s)}
            wait_for_peers(rendezvous["store"], rank=rank, world_size=world_size, node_rank=node_rank,
                           timeout_s=timeout_s)
        else:
            rendezvous = {"init_method": f"tcp://{master_addr}:{master_port}"}
        dist.init_process_group(
            backend=backend,
            **rendezvous,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if backend == "nccl" else None,
        )
    spans_nodes = from_launcher_env and world_size > 1 and local_world_size != world_size
    return World(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        device=device,
        backend=backend,
        timeout_s=timeout_s,
        node_rank=node_rank,
        node_sizes=gather_node_sizes(node_rank, world_size) if spans_nodes else None,
    )


def gather_node_sizes(node_rank: int, world_size: int) -> tuple[int, ...]:
    """Every node's number of ranks, by node rank: one all-gather of each rank's node rank."""
    nodes: list[int | None] = [None] * world_size
    dist.all_gather_object(nodes, node_rank)
    return tuple(nodes.count(node) for node in sorted(set(nodes)))


def _import_group_defaults() -> None:
    """Import torch.distributed.nn.functional before phalanx opens its group, so that leaving the
    world frees the group and ends gloo's threads.

    That module's functions take `group=group.WORLD` as default arguments, evaluated at its first
    import (any torch optimizer's constructor imports it, through torch._dynamo). Imported after
    init_process_group, the defaults hold the default group for good: destroy_process_group cannot
    free it, gloo's threads live on into interpreter exit, and one that needs the GIL there aborts
    the process (SIGABRT). Imported first, the defaults are None and stop_world frees the group.
    Only the group phalanx opens gets this: freeing a group early deadlocks a script that destroys
    it while its torch DDP model lives, so a script's own group keeps torch's behaviour - held to
    the end, it can at worst abort at exit, after the results are in (docs/how-it-works.md, Launcher).
    """
    import torch.distributed.nn.functional  # noqa: F401


def _launcher_store(master_addr: str, master_port: int, *, rank: int, world_size: int, timeout_s: float):
    """The store of a torchrun job (or a local phalanx run), under a prefix unique to this restart of it.

    torchrun's agent, or phalanx's launcher, hosts the store at MASTER_PORT
    (TORCHELASTIC_USE_AGENT_STORE=True; otherwise rank 0 hosts it, as `env://` would). After a
    restart (`--max-restarts`) the new workers can find the previous attempt's keys in it - gloo's
    peer addresses among them - and connect to a dead peer until the timeout, which shows as an
    intermittent "connectFullMesh ... Connection refused" or a hang in `new_group` (cf.
    pytorch/pytorch#167288). Prefixing every key with the run id and restart count makes each
    attempt's rendezvous its own.
    """
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(master_addr, master_port, world_size, is_master=not agent_hosts and rank == 0,
                          timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    return dist.PrefixStore(attempt_prefix(), store)


def adopt_world(*, local_rank: int, local_world_size: int, device: torch.device, timeout_s: float,
                node_rank: int = 0) -> World:
    """The World of a default process group the user's script opened itself (a torchrun script's
    own `init_process_group`), so `phalanx.init()` after it joins nothing twice."""
    world_size = dist.get_world_size()
    backend = "none" if world_size == 1 else ("nccl" if "nccl" in str(dist.get_backend()) and device.type == "cuda"
                                               else "gloo")
    return World(rank=dist.get_rank(), world_size=world_size, local_rank=local_rank,
                 local_world_size=local_world_size, device=device, backend=backend, timeout_s=timeout_s,
                 node_rank=node_rank)


def stop_world(world: World | None) -> None:
    """Leave the process group; safe to call twice or on a world that never started."""
    if world is not None and world.distributed:
        leave_default_group()


def leave_default_group() -> None:
    """Destroy the default process group if one is open (whoever opened it: phalanx, or a user's
    script or a benchmark contender that called init_process_group itself); else nothing."""
    if dist.is_initialized():
        dist.destroy_process_group()


def bound_default_group_timeout(timeout_s: float) -> None:
    """A group the script opens without `timeout=` gets `--timeout` instead of torch's default
    (30 minutes for gloo), so a hung collective fails the run as phalanx's own would. torch reads
    these module defaults when `init_process_group` is called without a timeout."""
    c10d = dist.distributed_c10d
    timeout = datetime.timedelta(seconds=timeout_s)
    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):
        if getattr(c10d, name, None) is not None:
            setattr(c10d, name, timeout)
