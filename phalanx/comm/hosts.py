"""Which ranks share a host: the layout the hierarchical collectives run on, read from what the
launcher says (torchrun's node rank and local world size), and whether `auto` picks them.

`torchrun --nnodes H --nproc-per-node m` starts m workers on each of H machines and numbers the
machines by node rank (GROUP_RANK, `World.node_rank`): workers of one node rank share a host and
its memory, workers of different ones share only the network. phalanx never compares hostnames,
so hosts simulated on one machine (network namespaces, `phalanx.measure.hosts_bed`) behave as
real ones. `read_layout` is a collective: every rank's (node rank, local rank), all-gathered,
grouped by node rank, each host's ranks ordered by local rank. Every host must run the same
number of workers numbered 0..m-1, since local rank l of every host exchanges the same share of
each bucket with its peers (local rank l of the other hosts).

It also says the layout in words (the run's first line: `layout_text`), and a failed exchange
between hosts in one line naming both ends (`exchange_failed`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch.distributed as dist

from phalanx.comm.calls import collective
from phalanx.comm.watchdog import CommError
from phalanx.errors import RunFailed
from phalanx.runtime.tags import Tag
from phalanx.runtime.segment import per_host_text, shm_supported
from phalanx.runtime.world import World

_SET_UP = Tag("set-up")
# How a host's ranks share each bucket between hosts (hierarchical.py): `slices`, 1/m each; `leader`,
# all of it through local rank 0.
VARIANTS = ("slices", "leader")
DEFAULT_VARIANT = "slices"


class LayoutError(CommError):
    """The ranks' hosts do not form the layout the hierarchical collectives need."""


class HostExchangeError(RunFailed):
    """The exchange between hosts failed: a peer on another host died, or the link to it broke.
    Restartable (the machine's doing, as a stalled peer is); `culprit`: that peer's rank."""

    restartable = True

    def __init__(self, message: str, *, culprit: int | None = None) -> None:
        super().__init__(message)
        self.culprit = culprit


@dataclass(frozen=True)
class HostLayout:
    """The ranks of every host, and where this rank sits among them."""

    hosts: tuple[tuple[int, ...], ...]  # each host's global ranks by local rank; hosts by node rank
    rank: int  # this rank's global rank

    def __post_init__(self) -> None:
        sizes = sorted({len(ranks) for ranks in self.hosts})
        if len(sizes) != 1 or sizes[0] < 1:
            raise LayoutError(f"hosts run unequal numbers of workers ({[len(r) for r in self.hosts]}); the "
                              "hierarchical collectives need the same --nproc-per-node on every host")
        if sorted(r for ranks in self.hosts for r in ranks) != list(range(self.world_size)):
            raise LayoutError(f"the hosts' ranks {self.hosts} are not 0..{self.world_size - 1}, each once")

    @property
    def world_size(self) -> int:
        return sum(len(ranks) for ranks in self.hosts)

    @property
    def num_hosts(self) -> int:
        return len(self.hosts)

    @property
    def per_host(self) -> int:
        return len(self.hosts[0])

    @property
    def host(self) -> int:
        """This rank's host, by node rank order."""
        return next(h for h, ranks in enumerate(self.hosts) if self.rank in ranks)

    @property
    def local(self) -> int:
        """This rank's place on its host (its local rank)."""
        return self.hosts[self.host].index(self.rank)

    @property
    def members(self) -> tuple[int, ...]:
        """The ranks of this rank's host, which share its memory."""
        return self.hosts[self.host]

    def peers_of(self, local: int) -> tuple[int, ...]:
        """Local rank `local` of every host, in host order: one exchange group between hosts."""
        return tuple(ranks[local] for ranks in self.hosts)

    @property
    def peers(self) -> tuple[int, ...]:
        return self.peers_of(self.local)

    def where(self, rank: int) -> str:
        """`rank` as a failure names it: "rank 2 (host 1)"."""
        return f"rank {rank} (host {next(h for h, ranks in enumerate(self.hosts) if rank in ranks)})"


def single_host_layout(world: World) -> HostLayout:
    """Every rank of `world` on one host (what phalanx's own launcher starts)."""
    return HostLayout(hosts=(tuple(range(world.world_size)),), rank=world.rank)


def read_layout(world: World) -> HostLayout:
    """The layout of `world`'s hosts: a collective (call it at the same point on every rank).
    LayoutError, on every rank alike, where the hosts do not fit the hierarchical collectives."""
    if not world.distributed:
        return single_host_layout(world)
    entries: list = [None] * world.world_size
    with collective(world, _SET_UP):
        dist.all_gather_object(entries, (world.node_rank, world.local_rank))
    nodes = sorted({node for node, _ in entries})
    hosts = []
    for node in nodes:
        on_node = sorted((local, rank) for rank, (n, local) in enumerate(entries) if n == node)
        if [local for local, _ in on_node] != list(range(len(on_node))):
            locals_ = [local for local, _ in on_node]
            raise LayoutError(f"node {node}'s local ranks are {locals_}, not 0..{len(on_node) - 1}")
        hosts.append(tuple(rank for _, rank in on_node))
    return HostLayout(hosts=tuple(hosts), rank=world.rank)


def host_counts(world: World) -> tuple[int, int] | None:
    """(hosts, workers per host), or None for hosts of unequal sizes: from every node's size where
    the world gathered them (torchrun across nodes), else as this node's size divides the world.
    The node's own size alone misleads: nodes of 2 and 1 workers made node 0 find no hierarchy
    and node 1 find "1 per host", two first lines the pre-flight check refused; nodes of 2, 1
    and 1 would have chosen two different allreduces."""
    if world.node_sizes is not None:
        sizes = world.node_sizes
        return (len(sizes), sizes[0]) if len(set(sizes)) == 1 else None
    m, k = world.local_world_size, world.world_size
    return None if k % m else (k // m, m)


def hierarchy_applies(world: World) -> str | None:
    """None where `auto` picks the hierarchical collectives - CPU workers, at least 2 hosts with
    at least 2 workers each, shared memory usable - else why not (one phrase)."""
    if world.device.type != "cpu":
        return f"the hierarchical allreduce serves CPU workers; this world runs on {world.device.type}"
    counts = host_counts(world)
    if counts is None:
        unequal = (f"the hosts run unequal numbers of workers ({per_host_text(world)})" if world.node_sizes else
                   f"{world.world_size} ranks do not divide into hosts of {world.local_world_size} workers")
        return f"{unequal}; the hierarchical allreduce needs the same --nproc-per-node on every host"
    hosts, per_host = counts
    if hosts < 2:
        return "all ranks share one host"
    if per_host < 2:
        return f"each of the {hosts} hosts runs one worker: there is nothing to share within a host"
    return shm_supported()


def exchange_failed(layout: HostLayout, op: str, exc: BaseException) -> HostExchangeError:
    """The one-line error of a failed exchange between hosts, naming this rank's peers there."""
    others = [r for r in layout.peers if r != layout.rank]
    named = " and ".join(layout.where(r) for r in others)
    return HostExchangeError(f"{layout.where(layout.rank)} lost its exchange with {named} in a hierarchical {op}: "
                             f"{backend_reason(exc)} (that host stopped, or the link to it failed)",
                             culprit=others[0] if others else None)


def backend_reason(exc: BaseException) -> str:
    """gloo's message without its source location and advice: "Read error [10.77.0.2]:8838:
    Connection reset by peer"."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    return text.split(". This is typically")[0].rstrip(".")


def layout_text(hosts: int, per_host: int, variant: str = DEFAULT_VARIANT) -> str:
    """"shm within each of 2 hosts x 2 workers, gloo between hosts, 1/2 of each bucket per link"."""
    share = "the whole bucket from one leader per host" if variant == "leader" or per_host == 1 \
        else f"1/{per_host} of each bucket per link"
    return f"shm within each of {hosts} hosts x {per_host} workers, gloo between hosts, {share}"


def hierarchy_text(world: World) -> str | None:
    """`layout_text` for `world`'s hosts as the launcher's sizes give them (None where they do
    not divide), with the default variant: what a replica's first line says."""
    counts = host_counts(world)
    return None if counts is None else layout_text(*counts)
