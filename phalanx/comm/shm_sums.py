"""The sums of the shm collectives' Python rounds (shm.py, shm_ops.py), in rank order so every
result is deterministic, and where each rank's chunk of a large round begins and ends."""

from __future__ import annotations

import math

import torch

from phalanx.comm.shm_flags import LINE


def sum_into(out: torch.Tensor, parts: list[torch.Tensor], scratch: torch.Tensor | None = None) -> None:
    """out = parts[0] + ... + parts[k-1], added in that order (k >= 2), so every shm sum is
    deterministic. A part may be `out` itself if `scratch` holds the partial sums until the last add."""
    acc = out if scratch is None or len(parts) == 2 else scratch
    torch.add(parts[0], parts[1], out=acc)
    for part in parts[2:-1]:
        acc.add_(part)
    if len(parts) > 2:
        torch.add(acc, parts[-1], out=out)


def chunk_of(numel: int, parts: int, index: int, element_size: int) -> tuple[int, int]:
    """[lo, hi) of chunk `index`: near-equal chunks whose bounds fall on 64-byte lines."""
    per_line = max(1, LINE // element_size)
    lines = math.ceil(numel / per_line)
    base, extra = divmod(lines, parts)
    lo_line = index * base + min(index, extra)
    hi_line = lo_line + base + (1 if index < extra else 0)
    return min(numel, lo_line * per_line), min(numel, hi_line * per_line)
