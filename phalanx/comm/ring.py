"""Bandwidth-optimal ring allreduce: a reduce-scatter followed by an all-gather around a ring.

The tensor is cut into k chunks (k = world size). In k-1 reduce-scatter steps each rank sends
one chunk to its right neighbour while receiving another from its left neighbour and adding it
to its own copy; afterwards rank r holds the complete sum of chunk (r+1) mod k. In k-1
all-gather steps the finished chunks travel once more around the ring and are copied into
place. Each rank sends 2(k-1)/k of the tensor in total, the lower bound for any allreduce
(Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", JPDC 69(2); cost model as in Thakur, Rabenseifner & Gropp 2005). The price is
2(k-1) latency terms, which is why the recursive-doubling tree wins for small tensors.
nccl-tests' PERFORMANCE.md defines bus bandwidth from exactly this factor:
busbw = algbw * 2(k-1)/k.

Each half is also a collective of its own (`reduce_scatter_ring`, `all_gather_ring`, for
sharded data parallelism): there the chunks are the caller's per-rank counts, however uneven,
and rank r ends owning chunk r (the phases take which chunk a rank ends with as `shift`). Each
half moves (k-1)/k of an even tensor; an empty chunk is skipped by both its sender and its
receiver, and a chunk owned by one rank alone (a one-owner bucket) travels k-1 hops in turn.

Each chunk travels as segments of at most `SEGMENT_BYTES`, all posted at once: a segment is
added as soon as it lands while the next ones are still on the wire (gloo's own ring pipelines
segments the same way). Every point-to-point message costs gloo a handshake (the receiver
announces its buffer before data flows, ~0.1-0.3 ms on loopback), so segments are large: on
these machines 1 MB beat 64-256 KB at every size from 1 MB to 64 MB (k = 2, interleaved runs).

Every chunk's sum is computed once, on the rank that finishes it, and then only copied, so all
ranks end bitwise identical.
"""

from __future__ import annotations

from typing import Sequence

import torch

from phalanx.comm.transport import DistTransport, Transport
from phalanx.data.split import shard_sizes
from phalanx.runtime.world import World

# Segment size of the pipeline; measured on loopback gloo with `phalanx bench allreduce`.
SEGMENT_BYTES = 1 << 20


def chunk_sizes(numel: int, parts: int) -> list[int]:
    """Split `numel` elements into `parts` chunks whose sizes differ by at most one: the book's
    `split_batch` cut (`data.split.shard_sizes`), so chunk 0 is always the largest and chunks at
    the end are empty when numel < parts."""
    return shard_sizes(numel, parts)


def segments(chunk: torch.Tensor, segment_bytes: int = SEGMENT_BYTES) -> list[torch.Tensor]:
    """Cut a contiguous chunk into near-equal contiguous views of at most ~segment_bytes each.

    Depends only on the chunk's length and dtype, so sender and receiver cut alike. An empty
    chunk has no segments.
    """
    numel = chunk.numel()
    if numel == 0:
        return []
    per_segment = max(1, segment_bytes // chunk.element_size())
    return list(chunk.split(chunk_sizes(numel, -(-numel // per_segment))))


def allreduce_ring(
    flat: torch.Tensor, *, world: World, transport: Transport | None = None, segment_bytes: int = SEGMENT_BYTES
) -> None:
    """Sum the contiguous 1-D `flat` in place across the world with the ring algorithm."""
    k = world.world_size
    if k == 1 or flat.numel() == 0:
        return
    chunks = flat.split(chunk_sizes(flat.numel(), k))  # views into flat, each contiguous
    transport = transport if transport is not None else DistTransport()
    # Rank r finishes chunk r+1 (shift 1, as the ring was first written: its sums keep their bits).
    reduce_scatter_phase(chunks, world=world, transport=transport, shift=1, segment_bytes=segment_bytes)
    all_gather_phase(chunks, world=world, transport=transport, shift=1, segment_bytes=segment_bytes)


def reduce_scatter_ring(flat: torch.Tensor, *, counts: Sequence[int], world: World, transport: Transport | None = None,
                        segment_bytes: int = SEGMENT_BYTES) -> None:
    """Leave in rank r's range of `flat` (counts[r] elements from the sum of the counts before it)
    the sum of that range over all ranks: the ring's first half, with `counts` as its chunks."""
    if world.world_size > 1 and flat.numel():
        reduce_scatter_phase(flat.split(list(counts)), world=world, shift=0, segment_bytes=segment_bytes,
                             transport=transport if transport is not None else DistTransport())


def all_gather_ring(flat: torch.Tensor, *, counts: Sequence[int], world: World, transport: Transport | None = None,
                    segment_bytes: int = SEGMENT_BYTES) -> None:
    """Give every rank every rank's range of `flat` (rank r's: counts[r] elements): the ring's
    second half, with `counts` as its chunks."""
    if world.world_size > 1 and flat.numel():
        all_gather_phase(flat.split(list(counts)), world=world, shift=0, segment_bytes=segment_bytes,
                         transport=transport if transport is not None else DistTransport())


def reduce_scatter_phase(chunks: Sequence[torch.Tensor], *, world: World, transport: Transport, shift: int,
                         segment_bytes: int = SEGMENT_BYTES) -> None:
    """k-1 steps after which rank r holds the whole sum of chunk (r + shift) mod k.

    At step s rank r forwards chunk r+shift-1-s (which it finished adding at step s-1; at step 0
    its own) to the right and receives chunk r+shift-2-s from the left, segment by segment,
    adding each as it lands. An empty chunk has no segments: neither side sends or waits."""
    k, rank = world.world_size, world.rank
    right, left = (rank + 1) % k, (rank - 1) % k
    # The one allocation: a receive buffer as large as the largest chunk.
    scratch = torch.empty(max(c.numel() for c in chunks), dtype=chunks[0].dtype, device=chunks[0].device)
    for step in range(k - 1):
        outgoing = chunks[(rank + shift - 1 - step) % k]
        incoming = chunks[(rank + shift - 2 - step) % k]
        landing = segments(scratch[: incoming.numel()], segment_bytes)
        targets = segments(incoming, segment_bytes)
        transport.exchange(
            sends=[(right, seg) for seg in segments(outgoing, segment_bytes)],
            recvs=[(left, seg) for seg in landing],
            on_received=lambda i, targets=targets, landing=landing: targets[i].add_(landing[i]),
        )


def all_gather_phase(chunks: Sequence[torch.Tensor], *, world: World, transport: Transport, shift: int,
                     segment_bytes: int = SEGMENT_BYTES) -> None:
    """k-1 steps that spread chunk (r + shift) mod k from each rank r to all: at step s rank r
    forwards chunk r+shift-s and receives chunk r+shift-1-s straight into place (nothing is
    added, so no scratch; and every chunk's bits are its finisher's on every rank)."""
    k, rank = world.world_size, world.rank
    right, left = (rank + 1) % k, (rank - 1) % k
    for step in range(k - 1):
        outgoing = chunks[(rank + shift - step) % k]
        incoming = chunks[(rank + shift - 1 - step) % k]
        transport.exchange(sends=[(right, seg) for seg in segments(outgoing, segment_bytes)],
                           recvs=[(left, seg) for seg in segments(incoming, segment_bytes)])
