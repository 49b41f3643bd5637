"""Bus bandwidth as nccl-tests' PERFORMANCE.md defines it: the one factor that makes a collective's
speed comparable across world sizes, collectives and links.

algbw = size / time, size being the whole buffer; busbw = algbw x 2(k-1)/k for an allreduce and
x (k-1)/k for a reduce-scatter or an all-gather: the share of the data each of k ranks must move
over its link, so a ring's busbw approaches the link's bandwidth whatever k. `bench allreduce`,
`--trace`'s summary and `predict` all read it from here.
"""

from __future__ import annotations

# Per byte of the buffer, how many each rank moves, in units of (k-1)/k.
_SHARE = {"allreduce": 2.0, "reduce-scatter": 1.0, "all-gather": 1.0}
COLLECTIVES = tuple(_SHARE)


def busbw_factor(world_size: int, collective: str = "allreduce") -> float:
    """busbw / algbw for `collective` on `world_size` ranks (0 at one rank: nothing moves)."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if collective not in _SHARE:
        raise ValueError(f"collective {collective!r} is unknown; choose one of {', '.join(_SHARE)}")
    return _SHARE[collective] * (world_size - 1) / world_size
