"""What an even split must be, checked in one place for the two functions that make one: the
ring's `chunk_sizes` (phalanx.comm.ring) and a global batch's `shard_sizes` (phalanx.data.split)."""

from __future__ import annotations


def assert_even_split(sizes: list[int], total: int, parts: int) -> None:
    """`parts` sizes that sum to `total`, differ by at most one, larger ones first."""
    assert len(sizes) == parts
    assert sum(sizes) == total
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
