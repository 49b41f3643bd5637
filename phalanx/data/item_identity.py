"""What tells one stream item from another, the same way in every process: a checksum of the
items' identities, for comparing what the ranks' streams yield (train/sharded_loader.py).

An item's identity is what a random augmentation leaves alone: its strings and bytes (a key, a
file name, a caption, an undecoded image), its whole numbers (a label, an index) and its 1-D
integer tensors and arrays (token ids). Floating values and tensors of 2 or more dimensions (a
decoded, perhaps randomly cropped image; an audio clip) are left out, and so is any other object:
a stream that augments each rank's items with that rank's own random numbers still yields the
same items. Python's `hash` is seeded per process, so the checksum is CRC-32 over bytes.
A map-style dataset's identity adds its `Subset` indices (`subset_checksum`), which a
`random_split` drawn per rank changes where its items' identities cannot (float targets).
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

import torch
from torch.utils.data import Subset


def identity_checksum(items: list) -> tuple[int, int]:
    """(how many identity values the items hold, their CRC-32 in order); (0, 0) when none."""
    found = [0, 0]
    for item in items:
        _walk(item, found)
    return found[0], found[1]


def _walk(value: Any, found: list[int]) -> None:
    if isinstance(value, (str, bytes, bool, int)):
        _add(_bytes_of(value), found)
    elif isinstance(value, torch.Tensor):
        if value.dim() <= 1 and not value.is_floating_point() and not value.is_complex():
            _add(value.detach().cpu().contiguous().numpy().tobytes(), found)
    elif getattr(value, "ndim", None) in (0, 1) and _kind(value) in ("i", "u", "b"):
        _add(value.tobytes(), found)  # a numpy array or scalar
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _walk(key, found)
            _walk(item, found)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            _walk(getattr(value, field.name), found)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _walk(item, found)


def _kind(value: Any) -> str | None:
    """A numpy dtype's kind letter (i: signed, u: unsigned, b: bool); None for anything else."""
    return getattr(getattr(value, "dtype", None), "kind", None)


def _bytes_of(value: str | bytes | bool | int) -> bytes:
    if isinstance(value, str):
        return b"s" + value.encode("utf-8", "surrogatepass")
    if isinstance(value, bytes):
        return b"b" + value
    return b"i" + struct.pack("<q", int(value)) if -2 ** 63 <= value < 2 ** 63 else b"I" + str(value).encode()


def _add(data: bytes, found: list[int]) -> None:
    found[0] += 1
    found[1] = zlib.crc32(struct.pack("<I", len(data)) + data, found[1])


def subset_checksum(dataset) -> int:
    """A CRC of the indices of `dataset`'s `Subset`s (what `random_split` returns), outermost first;
    -1 for a dataset that is no Subset."""
    crc = -1
    while isinstance(dataset, Subset):
        crc = zlib.crc32(np.asarray(dataset.indices, dtype=np.int64).tobytes(), max(crc, 0))
        dataset = dataset.dataset
    return crc
