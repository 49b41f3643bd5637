"""The D2L book's allreduce ("Training on Multiple GPUs", section 13.5): gather to rank 0, sum, send back.

Every rank sends its whole tensor to rank 0; rank 0 adds them in rank order
(x0 + x1 + ... + x_{k-1}) and sends the sum to every other rank, which overwrites its tensor.
Cost (Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations
in MPICH", IJHPCA 19(1), notation alpha = latency, beta = time per byte, n bytes, k ranks):
rank 0 serialises 2(k-1) full messages, about 2(k-1)(alpha + n*beta), so time grows linearly
with k while the ring's bandwidth term stays at 2(k-1)/k * n*beta. It is kept as the
baseline the book starts from. Every rank ends with rank 0's bytes: replicas stay identical.
"""

from __future__ import annotations

import torch

from phalanx.comm.transport import DistTransport, Transport
from phalanx.runtime.world import World


def allreduce_naive(flat: torch.Tensor, *, world: World, transport: Transport | None = None) -> None:
    """Sum the contiguous 1-D `flat` in place across the world via rank 0."""
    k = world.world_size
    if k == 1 or flat.numel() == 0:  # every rank holds the same numel, so all return together
        return
    transport = transport if transport is not None else DistTransport()
    if world.rank != 0:
        # Two separate steps: receiving into `flat` while it is still being sent would race.
        transport.exchange(sends=[(0, flat)])
        transport.exchange(recvs=[(0, flat)])
        return
    # One scratch buffer, filled by each rank in turn, keeps the sum in a fixed (rank) order.
    scratch = torch.empty_like(flat)
    for src in range(1, k):
        transport.exchange(recvs=[(src, scratch)])
        flat.add_(scratch)
    transport.exchange(sends=[(dst, flat) for dst in range(1, k)])
