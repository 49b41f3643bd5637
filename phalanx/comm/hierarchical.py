"""The hierarchical collectives, for CPU workers on several hosts: shared memory within each host,
one exchange between hosts over gloo (what NCCL does inside itself for GPUs, and Horovod's
HOROVOD_HIERARCHICAL_ALLREDUCE for NCCL + MPI; gloo has no such path for CPU workers).

An allreduce of a bucket on H hosts of m workers (`Hierarchy` holds what it runs on):

1. Within each host, a reduce-scatter through the host's shared segment (shm_ops.py): local
   rank l ends with the host's sum of its share of the bucket.
2. Between hosts, local rank l allreduces its share with its peers, local rank l of every other
   host, with gloo's own allreduce on a private group of theirs.
3. Within each host, an all-gather through the segment: every rank ends with the whole bucket.

A bucket goes through in windows of the segment's slot (4 MB), and window w's exchange between
hosts (step 2, gloo's async op) is in flight while window w+1 is summed within the host and
window w-1 gathered: the link stays busy while memory does its part. On the simulated-hosts bed
(2 hosts x 2 workers, 1 Gbit/s links, the MLP's 23 MB gradient, a loaded 2-core machine) that
took 0.20-0.22 s per allreduce against 0.25-0.28 s with the three steps one after another (and
the exchange on phalanx's ring); the link's floor is 0.19 s, gloo's flat allreduce 0.29 s.

The share is the variant (`VARIANTS`): `slices` gives local rank l the l-th of m near-equal
slices (cut on 64-byte lines), so m streams cross each host's link at once, each with 1/m of
the bucket; `leader` gives local rank 0 the whole bucket (one leader per host). Each host's link
carries 2(H-1)/H of the bucket either way (the counters read so, within 0.3%); `slices` splits
it over m TCP streams and m cores and was the faster on the bed, 0.20-0.22 s against 0.22-0.25 s
for `leader` in the same runs: it is the default.

Every element is summed in a fixed order - its host's ranks in local order, then the hosts in
gloo's ring order, which depends only on the group and the size - once, and only copied after:
every rank ends bitwise identical, run to run.

Reduce-scatter and all-gather (sharded stages, per-rank `counts`) run the same three steps in
their halves, the exchange between hosts on phalanx's ring (ring.py, whose per-rank chunks are
exactly the counts). Their ranges are reordered first so that each local rank's share is contiguous:
local rank l's share is the ranges of the ranks l of every host, in host order, which is what
its peers' exchange cuts into their pieces. In a world on one host (H = 1) this is shm's
reduce-scatter and all-gather; with one worker per host (m = 1), the ring over the hosts.

No step relies on another host's memory: each host's segment is named to its own ranks only
(`share_segment(host=...)`), as a real host cannot open another's /dev/shm.
"""

from __future__ import annotations

import datetime
import math
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from phalanx.comm.calls import collective
from phalanx.comm.counts import own_range
from phalanx.comm.hosts import DEFAULT_VARIANT, VARIANTS, HostLayout, exchange_failed, read_layout
from phalanx.comm.ring import all_gather_ring, reduce_scatter_ring
from phalanx.comm.shm import SLOT_BYTES, ShmGroup
from phalanx.comm.shm_ops import all_gather_shm, reduce_scatter_shm
from phalanx.comm.transport import DistTransport
from phalanx.runtime.board import Ticket
from phalanx.runtime.tags import Tag
from phalanx.runtime.world import World

_LINE = 64
_SET_UP = Tag("set-up")


class Hierarchy:
    """What the hierarchical collectives run on: the hosts' layout, this host's shared segment
    and the gloo group of this rank's peers on the other hosts. Open it at the same point on
    every rank (a collective); close it before stop_world."""

    def __init__(self, *, world: World, variant: str = DEFAULT_VARIANT, layout: HostLayout | None = None,
                 slot_bytes: int = SLOT_BYTES) -> None:
        """`variant`: how a bucket is shared among a host's ranks (VARIANTS); `layout`: the
        hosts (default: read from the world, a collective); `slot_bytes`: the segment's (shm.py)."""
        if variant not in VARIANTS:
            raise ValueError(f"unknown hierarchical variant {variant!r}; choose one of {', '.join(VARIANTS)}")
        self.world, self.variant = world, variant
        self.layout = read_layout(world) if layout is None else layout
        lay = self.layout
        # The segment's view (local ranks) and the ring's (hosts): what those algorithms number.
        self.host_world = World(rank=lay.local, world_size=lay.per_host, local_rank=lay.local,
                                local_world_size=lay.per_host, device=world.device, backend=world.backend,
                                timeout_s=world.timeout_s, node_rank=world.node_rank)
        self.peer_world = World(rank=lay.host, world_size=lay.num_hosts, local_rank=0, local_world_size=1,
                                device=world.device, backend=world.backend, timeout_s=world.timeout_s,
                                node_rank=world.node_rank)
        self.shm: ShmGroup | None = None
        self._group = None
        self.transport: DistTransport | None = None
        if not world.distributed:
            return
        # Every rank creates every peer group, in the same order (torch's rule for new groups).
        with collective(world, _SET_UP):
            self._group, _ = dist.new_subgroups_by_enumeration(
                [list(lay.peers_of(local)) for local in range(lay.per_host)], backend="gloo",
                timeout=datetime.timedelta(seconds=world.timeout_s))
        self.transport = DistTransport(group=self._group, ranks=lay.peers)
        if lay.per_host > 1:
            try:
                self.shm = ShmGroup(world=world, host=lay.members, slot_bytes=slot_bytes)
            except BaseException:
                self.close()  # the peer group too: a caller that falls back keeps nothing of this
                raise

    def shares(self, numel: int, element_size: int) -> list[int]:
        """Each local rank's share of an allreduce of `numel` elements, in elements."""
        return bucket_shares(numel, element_size, per_host=self.layout.per_host, variant=self.variant)

    def across(self, op: str, fn: Callable[[], None]) -> None:
        """Run this rank's exchange with its peers on the other hosts; a failure of the link or of
        a peer is raised naming the peers it was with."""
        try:
            fn()
        except RuntimeError as exc:  # gloo's errors (DistBackendError is one)
            raise exchange_failed(self.layout, op, exc) from exc

    def start_across(self, share: torch.Tensor):
        """Start the allreduce of this rank's `share` with its peers on the other hosts (gloo's
        own, on their group); its work, or None when there is one host."""
        if self.layout.num_hosts == 1:
            return None
        works: list = []
        self.across("allreduce", lambda: works.append(dist.all_reduce(share, op=dist.ReduceOp.SUM, group=self._group,
                                                                       async_op=True)))
        return works[0]

    def finish_window(self, piece: torch.Tensor, shares: list[int], work, *, ticket: Ticket | None) -> None:
        """Wait for a window's exchange between hosts, then gather the window within the host."""
        if work is not None:
            self.across("allreduce", work.wait)
        if self.shm is not None:
            all_gather_shm(piece, counts=shares, world=self.host_world, transport=self.shm, ticket=ticket)

    def abort(self) -> None:
        if self.shm is not None:
            self.shm.abort()

    def close(self) -> None:
        """Unmap the segment and leave the peer group; safe to call twice."""
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
        self._group = None


def bucket_shares(numel: int, element_size: int, *, per_host: int, variant: str = DEFAULT_VARIANT) -> list[int]:
    """How a host's `per_host` ranks share a bucket of `numel` elements: near-equal slices cut on
    64-byte lines (`slices`), or all of it to local rank 0 (`leader`)."""
    if variant == "leader":
        return [numel] + [0] * (per_host - 1)
    per_line = max(1, _LINE // element_size)
    lines = math.ceil(numel / per_line)
    base, extra = divmod(lines, per_host)
    bounds = [min(numel, (i * base + min(i, extra)) * per_line) for i in range(per_host + 1)]
    return [hi - lo for lo, hi in zip(bounds, bounds[1:])]


def allreduce_hierarchical(flat: torch.Tensor, *, world: World, transport: Hierarchy | None = None,
                           ticket: Ticket | None = None) -> None:
    """Sum the contiguous 1-D `flat` in place across `world`: within each host, between hosts,
    within each host again (the module docstring), one window of the segment's slot at a time,
    each window's exchange between hosts in flight while the next is summed within the host."""
    if not world.distributed or flat.numel() == 0:
        return
    h = _hierarchy(transport, "allreduce")
    windows = h.shm.windows(flat) if h.shm is not None else [(0, flat.numel())]
    pending = None
    for start, stop in windows:
        piece = flat[start:stop]
        shares = h.shares(piece.numel(), piece.element_size())
        if h.shm is not None:
            reduce_scatter_shm(piece, counts=shares, world=h.host_world, transport=h.shm, ticket=ticket)
        lo, hi = own_range(shares, h.layout.local)
        work = h.start_across(piece[lo:hi]) if hi > lo else None
        if pending is not None:
            h.finish_window(*pending, ticket=ticket)
        pending = (piece, shares, work)
    if pending is not None:
        h.finish_window(*pending, ticket=ticket)


def reduce_scatter_hierarchical(flat: torch.Tensor, *, counts: Sequence[int], world: World,
                                transport: Hierarchy | None = None, ticket: Ticket | None = None) -> None:
    """Sum every rank's `flat` into each rank's own range (`counts`: elements per rank, in rank
    order), hierarchically; the rest of `flat` is left unspecified."""
    if not world.distributed or flat.numel() == 0:
        return
    h = _hierarchy(transport, "reduce-scatter")
    order = HostOrder(h.layout, counts)
    buf = order.gather(flat)
    lo, hi = own_range(order.shares, h.layout.local)
    if h.shm is not None:
        reduce_scatter_shm(buf, counts=order.shares, world=h.host_world, transport=h.shm, ticket=ticket)
    if hi > lo:
        h.across("reduce-scatter", lambda: reduce_scatter_ring(buf[lo:hi], counts=order.pieces, world=h.peer_world,
                                                               transport=h.transport))
    if buf is not flat:
        mine_lo, mine_hi = own_range(counts, world.rank)
        at = order.position[world.rank]
        flat[mine_lo:mine_hi].copy_(buf[at:at + mine_hi - mine_lo])


def all_gather_hierarchical(flat: torch.Tensor, *, counts: Sequence[int], world: World,
                            transport: Hierarchy | None = None, ticket: Ticket | None = None) -> None:
    """Fill every rank's range of `flat` with that rank's piece (its range on entry), everywhere."""
    if not world.distributed or flat.numel() == 0:
        return
    h = _hierarchy(transport, "all-gather")
    order = HostOrder(h.layout, counts)
    mine_lo, mine_hi = own_range(counts, world.rank)
    buf = flat if order.identity else torch.empty_like(flat)
    if buf is not flat:
        at = order.position[world.rank]
        buf[at:at + mine_hi - mine_lo].copy_(flat[mine_lo:mine_hi])
    lo, hi = own_range(order.shares, h.layout.local)
    if hi > lo:
        h.across("all-gather", lambda: all_gather_ring(buf[lo:hi], counts=order.pieces, world=h.peer_world,
                                                       transport=h.transport))
    if h.shm is not None:
        all_gather_shm(buf, counts=order.shares, world=h.host_world, transport=h.shm, ticket=ticket)
    if buf is not flat:
        order.scatter(buf, flat)


class HostOrder:
    """Per-rank ranges reordered by local rank, then host: local rank l's share is contiguous,
    and within it the pieces of its peers follow in host order (what their ring cuts)."""

    def __init__(self, layout: HostLayout, counts: Sequence[int]) -> None:
        self.counts = tuple(counts)
        self.ranks = [r for local in range(layout.per_host) for r in layout.peers_of(local)]
        self.identity = self.ranks == sorted(self.ranks)
        self.shares = [sum(self.counts[r] for r in layout.peers_of(local)) for local in range(layout.per_host)]
        self.pieces = [self.counts[r] for r in layout.peers]
        self.position, at = {}, 0
        for r in self.ranks:
            self.position[r] = at
            at += self.counts[r]

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        """`flat`'s ranges in this order (`flat` itself where the order is rank order)."""
        if self.identity:
            return flat
        return torch.cat([flat[slice(*own_range(self.counts, r))] for r in self.ranks])

    def scatter(self, buf: torch.Tensor, flat: torch.Tensor) -> None:
        for r in self.ranks:
            lo, hi = own_range(self.counts, r)
            if hi > lo:
                flat[lo:hi].copy_(buf[self.position[r]:self.position[r] + hi - lo])


def _hierarchy(transport, op: str) -> Hierarchy:
    if not isinstance(transport, Hierarchy):
        raise ValueError(f"the hierarchical {op} needs its hosts' resources: pass transport=Hierarchy(world=...) "
                         "or use AsyncComm(world=..., algorithms=('hierarchical',))")
    return transport
