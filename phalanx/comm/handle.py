"""A launched collective's `Handle`: what `AsyncComm`'s async calls return. As torch's `Work`, a
second wait returns at once (or raises the first wait's error again).

Until the wait returns, the tensor must not be read or written (picotron and DDP follow the same
contract for their buckets). An allreduce of a non-contiguous tensor runs on a contiguous copy
(`flat_of`), which the wait writes back; a reduce-scatter's handle holds the view of this rank's
range, an all-gather's the flat tensor itself.
"""

from __future__ import annotations

from typing import Callable

import torch


class Handle:
    """One launched collective. `wait()` blocks until done, writes back, returns the tensor."""

    def __init__(self, tensor: torch.Tensor, flat: torch.Tensor | None, wait_fn: Callable[[], None]) -> None:
        self._tensor = tensor
        self._flat = flat  # a contiguous copy to write back, or None when the tensor was used as is
        self._wait_fn = wait_fn
        self._waited = False
        self._failed: BaseException | None = None

    @property
    def waited(self) -> bool:
        return self._waited

    def wait(self) -> torch.Tensor:
        if self._failed is not None:
            raise self._failed
        if self._waited:
            return self._tensor
        self._waited = True
        try:
            self._wait_fn()
        except BaseException as exc:
            self._failed = exc
            raise
        if self._flat is not None:
            with torch.no_grad():
                self._tensor.copy_(self._flat.view(self._tensor.shape))
        return self._tensor


def done() -> None:
    """The wait of a collective that had nothing to wait for (a world of one)."""
    return None


def flat_of(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A contiguous 1-D view of `tensor` (or a copy), and the copy to write back (None: a view)."""
    if tensor.is_contiguous():
        return tensor.view(-1), None
    with torch.no_grad():
        flat = tensor.contiguous().view(-1)
    return flat, flat
