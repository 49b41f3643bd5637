"""Gradient accumulation: `dp.no_sync()`, and as a loop `for piece in dp.accumulate(n): ...` (Accelerate's name).

`no_sync()` is the mechanism (DDP's): backwards inside it only add into the buckets, and the
first synced backward after it sends the sum; it turns the replica's `require_backward_grad_sync`
off and restores the previous value on the way out, even on error. `accumulate` wraps it for the usual shape of a
loop over micro-batches: every item but the last is yielded inside `no_sync()`, the last
outside, so its backward launches the exchange. The next item is fetched *before* the current
one is yielded, which is how an iterator of unknown length learns which item is last. With
`shard_loss(loss_sum, global_size)` per micro-batch (the *step's* global batch size) the summed
gradient is the 1-device gradient of the whole global batch, as `train_batch`'s accumulation.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator

from phalanx.errors import Misuse


@contextlib.contextmanager
def no_sync(replica, *, enabled: bool = True) -> Iterator[None]:
    """`replica`'s (a DataParallel's) backwards accumulate locally inside (see the module docstring);
    `enabled=False` (Fabric's `no_backward_sync(model, enabled=...)`): nothing changes, they sync."""
    if not enabled:
        yield
        return
    if replica.exchange_in_flight:
        raise Misuse("no_sync() entered while gradient allreduces are in flight; finish them first")
    previous = replica.require_backward_grad_sync
    replica.require_backward_grad_sync = False
    try:
        yield
    finally:
        replica.require_backward_grad_sync = previous


def accumulate(no_sync: Callable[[], contextlib.AbstractContextManager], micro_batches: int | Iterable) -> Iterator:
    """Yield `micro_batches`' items (an int n: 0..n-1), all but the last inside `no_sync()`."""
    if isinstance(micro_batches, int):
        if micro_batches < 1:
            raise ValueError(f"accumulate({micro_batches}): the number of micro-batches must be at least 1")
        micro_batches = range(micro_batches)
    return _accumulate(no_sync, iter(micro_batches))


def _accumulate(no_sync: Callable[[], contextlib.AbstractContextManager], items: Iterator) -> Iterator:
    try:
        current = next(items)
    except StopIteration:
        return
    for upcoming in items:  # fetched first: `current` is synced only when it is the last
        with no_sync():
            yield current
        current = upcoming
    yield current
