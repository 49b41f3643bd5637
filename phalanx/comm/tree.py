"""Latency-optimal allreduce by recursive doubling, with a fold for non-power-of-two worlds.

Among p = 2^m ranks, step i (mask = 2^i) pairs rank r with r XOR mask; the two exchange their
whole buffers and both add. After m = log2 p steps every rank holds the full sum: m latency
terms instead of the ring's 2(k-1), at the price of sending the whole tensor m times, so it
suits small tensors (Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective
Communication Operations in MPICH", IJHPCA 19(1), the allreduce section).

When k is not a power of two, let p be the largest power of two below k. The k - p extra ranks
first fold their data into a partner (extra rank p+i sends to rank i, which adds), the p ranks
run recursive doubling, and each partner sends the result back to its extra rank (the same
fold MPICH uses, there with even/odd pairs; here rank i pairs with p+i).

Bitwise identical results on all ranks: every addition is `lower rank's buffer + higher rank's
buffer`, so two partners compute the same operation on the same operands. (IEEE addition is
commutative anyway; the fixed order also keeps this true for any future non-commutative
reduction, and makes the order readable.) Extra ranks receive their partner's bytes verbatim.
"""

from __future__ import annotations

import torch

from phalanx.comm.transport import DistTransport, Transport
from phalanx.runtime.world import World


def largest_power_of_two(k: int) -> int:
    """The largest power of two <= k (k >= 1): the size of the recursive-doubling group."""
    if k < 1:
        raise ValueError(f"world size must be >= 1, got {k}")
    return 1 << (k.bit_length() - 1)


def fold_partner(rank: int, world_size: int) -> int | None:
    """The rank this one folds with before/after recursive doubling, or None.

    Extra rank p+i pairs with rank i; ranks without an extra partner return None.
    """
    p = largest_power_of_two(world_size)
    if rank >= p:
        return rank - p
    return rank + p if rank + p < world_size else None


def doubling_partners(rank: int, world_size: int) -> list[int]:
    """Partners of `rank` in the recursive-doubling steps, in step order (empty for extra ranks)."""
    p = largest_power_of_two(world_size)
    if rank >= p:
        return []
    return [rank ^ (1 << i) for i in range(p.bit_length() - 1)]


def allreduce_tree(flat: torch.Tensor, *, world: World, transport: Transport | None = None) -> None:
    """Sum the contiguous 1-D `flat` in place across the world by recursive doubling."""
    k, rank = world.world_size, world.rank
    if k == 1 or flat.numel() == 0:
        return
    transport = transport if transport is not None else DistTransport()
    p = largest_power_of_two(k)
    partner = fold_partner(rank, k)

    if rank >= p:
        # Extra rank: hand the data to the partner, then wait for the finished sum. Two steps,
        # since receiving into `flat` while it is still being sent would race.
        transport.exchange(sends=[(partner, flat)])
        transport.exchange(recvs=[(partner, flat)])
        return

    scratch = torch.empty_like(flat)  # the one allocation: a full-size receive buffer
    if partner is not None:
        transport.exchange(recvs=[(partner, scratch)])
        flat.add_(scratch)  # this rank is the lower one: its buffer first

    for peer in doubling_partners(rank, k):
        transport.exchange(sends=[(peer, flat)], recvs=[(peer, scratch)])
        if rank < peer:
            flat.add_(scratch)
        else:
            torch.add(scratch, flat, out=flat)

    if partner is not None:
        transport.exchange(sends=[(partner, flat)])
