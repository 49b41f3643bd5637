"""A rank's empty share of a global batch, shaped like a real one.

When a global batch holds fewer examples than there are ranks (an epoch's small last batch, a
micro-batch smaller than k), some rank's share is empty; it must still run its forward and
backward, so that its gradient exchange pairs with its peers'. `empty_batch_like` cuts one
collated example to 0 rows, keeping the batch's structure (tensors, mappings, dataclasses, named
tuples), so the rank's model sees the same types with no example, never a phantom one.
`ShardCollate` is a loader's collate that does it for an empty index list.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch.utils.data import Dataset


_LEAVES = (str, bytes, int, float, bool, type(None))


def empty_batch_like(batch: Any) -> Any:
    """`batch` (one example collated) with every batch dimension cut to 0: each tensor or array to
    0 rows (same dtypes, trailing shapes), a list or tuple of plain values or objects (a batch of
    strings, as default_collate gives a text field; of images) to none; mappings (a Hugging Face
    BatchEncoding too), dataclasses, named tuples and lists of fields keep their structure, and a
    plain value among them (a count) stays. Any other object would be the example itself, a
    phantom on a rank that holds none: TypeError."""
    if isinstance(batch, torch.Tensor) or (getattr(batch, "ndim", 0) >= 1 and hasattr(batch, "__getitem__")):
        return batch[:0]
    if isinstance(batch, Mapping):
        cut = {key: empty_batch_like(value) for key, value in batch.items()}
        try:
            return type(batch)(cut)
        except TypeError:  # a mapping whose constructor takes no dict: its items as a plain one
            return cut
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: empty_batch_like(getattr(batch, f.name))
                                             for f in dataclasses.fields(batch) if f.init})
    if isinstance(batch, (tuple, list)):
        if hasattr(batch, "_fields"):  # a named tuple, as default_collate keeps it
            return type(batch)(*(empty_batch_like(value) for value in batch))
        if batch and not any(_is_structure(value) for value in batch):
            return type(batch)()  # the example's own values, not fields: none of them here
        return type(batch)(empty_batch_like(value) for value in batch)
    if isinstance(batch, _LEAVES):
        return batch
    raise TypeError(f"a rank whose share of a global batch is empty gets an empty batch shaped like one example's, "
                    f"and the collated batch holds a value of type {type(batch).__name__}, which phalanx cannot cut to "
                    "no examples; have collate_fn return tensors, arrays, lists, dicts or dataclasses of them, or use "
                    "a global batch size whose last batch has an example for every rank")


def _is_structure(value: Any) -> bool:
    """Whether `value` in a list is a field of a structure (a tensor, a container), not an example's value."""
    return (isinstance(value, (torch.Tensor, Mapping, list, tuple)) or getattr(value, "ndim", 0) >= 1
            or (dataclasses.is_dataclass(value) and not isinstance(value, type)))


class ShardCollate:
    """The user's collate, plus an empty batch (shaped like example 0's) for an empty shard."""

    def __init__(self, dataset: Dataset, collate_fn: Callable) -> None:
        self.dataset, self.collate_fn = dataset, collate_fn

    def __call__(self, items: list) -> Any:
        if items:
            return self.collate_fn(items)
        return empty_batch_like(self.collate_fn([self.dataset[0]]))
