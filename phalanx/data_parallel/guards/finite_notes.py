"""The NaN/Inf check's sums taken by the exchange itself: the shm allreduce notes a bucket's sum as it
copies the bucket in and the summed bucket's as it sums it (comm/shm.py's `notes`), in the passes
that move the data anyway, where the check (finite.py) would read the whole gradient twice more:
on 2 CPU workers, a 23 MB gradient (bench's 5.8 M-parameter MLP), 2.5-3 ms a step of 60-200.

A pair of float64s per bucket, [own, summed], lives here for the step in flight: the comm's thread
adds to it while the main thread goes on, and the check reads it only after the step's exchange was
waited (finish_gradient_sync), so nothing reads or reallocates it while a sum may write it. A step's
first launch zeroes them; a second backward of the step (a GAN's D on real, then on fake) adds to
them, as the check's own cells add.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

NOTED_DTYPES = (torch.float32, torch.float64)  # what the shm rounds sum (comm/shm_kernel.py); others: the check's own


class Taken(NamedTuple):
    """One bucket's notes of the step: where the check's table keeps its own sum, and both sums."""

    own_column: int
    own: torch.Tensor  # 0-d float64 views of the pair
    summed: torch.Tensor


class TransportNotes:
    """The pairs of the step in flight, one per launched bucket, by bucket index."""

    def __init__(self) -> None:
        self._pairs: torch.Tensor | None = None  # [buckets, 2] float64
        self._own_columns: dict[int, int] = {}  # bucket index -> the check's own column, for this step's launches

    def pair(self, index: int, *, buckets: int, own_column: int) -> torch.Tensor:
        """Bucket `index`'s pair for the comm to add to (of `buckets` this step; `own_column`: where
        the check keeps this launch's own sum). The step's first launch zeroes every pair."""
        if not self._own_columns:  # nothing in flight: the last step's were taken
            if self._pairs is None or self._pairs.shape[0] < buckets:
                self._pairs = torch.zeros(buckets, 2, dtype=torch.float64)
            else:
                self._pairs.zero_()
        elif index >= self._pairs.shape[0]:
            raise RuntimeError(f"bucket {index} launched in a step laid out for {self._pairs.shape[0]}")
        self._own_columns.setdefault(index, own_column)
        return self._pairs[index]

    def take(self) -> dict[int, Taken]:
        """This step's notes by bucket index, once its exchange was waited; the next launch starts afresh."""
        taken = {index: Taken(column, self._pairs[index, 0], self._pairs[index, 1])
                 for index, column in self._own_columns.items()}
        self._own_columns = {}
        return taken
