"""The registry of allreduce algorithms by name: what `--allreduce` and configs may choose.

Every entry has the same shape, `allreduce_<name>(flat, *, world, ...) -> None`: it sums the
contiguous 1-D tensor `flat` in place across `world` and returns when done.
"""

from __future__ import annotations

from typing import Callable

from phalanx.comm.naive import allreduce_naive
from phalanx.comm.native import allreduce_native
from phalanx.comm.ring import allreduce_ring
from phalanx.comm.tree import allreduce_tree

ALGORITHMS = ("native", "ring", "tree", "naive")

_ALLREDUCE_FNS: dict[str, Callable[..., None]] = {
    "native": allreduce_native,
    "ring": allreduce_ring,
    "tree": allreduce_tree,
    "naive": allreduce_naive,
}


def allreduce_fn(algorithm: str) -> Callable[..., None]:
    """The allreduce function named `algorithm`; ValueError listing the valid names otherwise."""
    try:
        return _ALLREDUCE_FNS[algorithm]
    except (KeyError, TypeError):
        raise ValueError(f"unknown allreduce algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}") from None
