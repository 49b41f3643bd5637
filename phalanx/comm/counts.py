"""Per-rank counts: how reduce-scatter and all-gather cut one flat tensor into the ranks' ranges.

ZeRO-style sharding cuts one flat order of all parameters into k contiguous ranges of any sizes
(some empty); a bucket is a contiguous piece of that order, so its per-rank counts are as uneven
as the cut (often one rank owns all of it). Rank r's range starts at the sum of the counts
before it. Every rank must pass the same counts: they are part of the call, like its size.
"""

from __future__ import annotations

import operator
from typing import Sequence

import torch


def check_counts(flat: torch.Tensor, counts: Sequence[int], world_size: int, *, op: str) -> tuple[int, ...]:
    """`counts` as a tuple of ints if `flat` is a contiguous 1-D tensor that they cut into
    `world_size` ranges (one count per rank, none negative, summing to its numel); ValueError
    with the numbers otherwise."""
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"{op} needs a contiguous 1-D tensor, got shape {tuple(flat.shape)} with strides "
                         f"{flat.stride()}; pass a flat buffer (tensor.view(-1) of a contiguous one)")
    counts = tuple(operator.index(c) for c in counts)
    if len(counts) != world_size:
        raise ValueError(f"{op} counts {list(counts)} have {len(counts)} entries for {world_size} ranks; "
                         "pass one count per rank")
    if any(c < 0 for c in counts):
        raise ValueError(f"{op} counts {list(counts)} include a negative count; each is a rank's elements (0 or more)")
    if sum(counts) != flat.numel():
        raise ValueError(f"{op} counts {list(counts)} sum to {sum(counts)}, but the tensor has {flat.numel()} "
                         "elements; the counts must cut all of it")
    return counts


def own_range(counts: Sequence[int], rank: int) -> tuple[int, int]:
    """[lo, hi) of rank `rank`'s range: its count, after the counts of the ranks before it."""
    lo = sum(counts[:rank])
    return lo, lo + counts[rank]
