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

Each chunk travels as segments of at most `SEGMENT_BYTES`, all posted at once: a segment is
added as soon as it lands while the next ones are still on the wire (gloo's own ring pipelines
segments the same way). Every point-to-point message costs gloo a handshake (the receiver
announces its buffer before data flows, ~0.1-0.3 ms on loopback), so segments are large: on
these machines 1 MB beat 64-256 KB at every size from 1 MB to 64 MB (k = 2, interleaved runs).

Every chunk's sum is computed once, on the rank that finishes it, and then only copied, so all
ranks end bitwise identical.
"""

from __future__ import annotations

import torch

from phalanx.comm.transport import DistTransport, Transport
from phalanx.data.split import shard_sizes
from phalanx.runtime.world import World

# Segment size of the pipeline; measured on loopback gloo with `phalanx bench allreduce`.
SEGMENT_BYTES = 1 << 20


def chunk_sizes(numel: int, parts: int) -> list[int]:
    """Split `numel` elements into `parts` chunks whose sizes differ by at most one: the book's
    `split_batch` cut (`data.split.shard_sizes`), so chunk 0 is always the largest (it sizes the
    ring's scratch) and chunks at the end are empty when numel < parts."""
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
    k, rank = world.world_size, world.rank
    if k == 1 or flat.numel() == 0:
        return
    transport = transport if transport is not None else DistTransport()
    chunks = flat.split(chunk_sizes(flat.numel(), k))  # views into flat, each contiguous
    right, left = (rank + 1) % k, (rank - 1) % k
    # The one allocation: a receive buffer as large as the largest chunk (chunk 0).
    scratch = torch.empty(chunks[0].numel(), dtype=flat.dtype, device=flat.device)

    # Reduce-scatter. At step s rank r forwards chunk r-s (which it finished adding at step
    # s-1) and receives chunk r-s-1 from the left, segment by segment, adding each as it lands.
    for step in range(k - 1):
        outgoing = chunks[(rank - step) % k]
        incoming = chunks[(rank - step - 1) % k]
        landing = segments(scratch[: incoming.numel()], segment_bytes)
        targets = segments(incoming, segment_bytes)
        transport.exchange(
            sends=[(right, seg) for seg in segments(outgoing, segment_bytes)],
            recvs=[(left, seg) for seg in landing],
            on_received=lambda i, targets=targets, landing=landing: targets[i].add_(landing[i]),
        )

    # All-gather. Rank r now owns the finished chunk r+1; at step s it forwards chunk r+1-s and
    # receives chunk r-s straight into place (no scratch needed: nothing is added).
    for step in range(k - 1):
        outgoing = chunks[(rank + 1 - step) % k]
        incoming = chunks[(rank - step) % k]
        transport.exchange(sends=[(right, seg) for seg in segments(outgoing, segment_bytes)],
                           recvs=[(left, seg) for seg in segments(incoming, segment_bytes)])
