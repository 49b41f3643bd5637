"""A state dict written one tensor at a time, in torch.save's format, for a model no rank holds whole.

Under `shard="parameters"` each rank keeps 1/k of the parameters; model.pt must still be the whole
model's state dict, `torch.load(..., weights_only=True)`-able like any other. `torch.save` needs
every tensor in memory at once, so this writes the same archive itself: the pickle first (it
names each tensor's dtype, shape and storage record, which needs no data), then each tensor's
record as the caller produces it - a bucket gathered, its parameters written, the bucket freed -
so the writing rank never holds more than its shard and one bucket.

The archive is what torch.save writes (a zip of `archive/data.pkl`, `archive/byteorder`,
`archive/data/<key>`, `archive/version`; each tensor rebuilt by `torch._utils._rebuild_tensor_v2`
from a typed storage): the format torch.load reads, loaded in weights-only mode by the same
restricted unpickler. Python's zipfile writes it with every record's CRC-32, stored uncompressed
as torch.save stores it. Tensors are written contiguous (a channels_last weight loads as a
contiguous one, with the same values).
"""

from __future__ import annotations

import collections
import io
import itertools
import math
import pickle
import sys
import zipfile
from pathlib import Path
from typing import Iterable, Sequence

import torch

from phalanx.atomic import atomic_open

_ARCHIVE = "archive"


class _StorageRecord:
    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorRecord:
    """Pickles as torch.save pickles a contiguous CPU tensor over its own storage record."""

    def __init__(self, storage: _StorageRecord, shape: Sequence[int]) -> None:
        self.storage, self.shape = storage, tuple(shape)

    def __reduce_ex__(self, protocol):
        stride = torch.empty(self.shape, device="meta").stride()
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, self.shape, stride, False, collections.OrderedDict()))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _StorageRecord):
            storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[obj.dtype])
            return ("storage", storage_type, obj.key, "cpu", obj.numel)
        return None


def write_streamed(path: str | Path, entries: Sequence[tuple[str, torch.dtype, Sequence[int]]],
                   tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Write a state dict of `entries` (name, dtype, shape; in the state dict's order) to `path`
    atomically, each tensor's data taken from `tensors` ((name, tensor) pairs in any order, each
    name once) as it comes. ValueError if a tensor is missing, repeated or does not fit its entry."""
    keys = {name: str(index) for index, (name, _, _) in enumerate(entries)}
    expected = {name: (dtype, tuple(shape)) for name, dtype, shape in entries}
    meta = collections.OrderedDict(
        (name, _TensorRecord(_StorageRecord(keys[name], dtype, math.prod(shape)), shape))
        for name, dtype, shape in entries)
    pickled = io.BytesIO()
    _Pickler(pickled, protocol=2).dump(meta)
    written: set[str] = set()
    with atomic_open(path) as handle, zipfile.ZipFile(handle, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        archive.writestr(f"{_ARCHIVE}/data.pkl", pickled.getvalue())
        archive.writestr(f"{_ARCHIVE}/byteorder", sys.byteorder)
        for name, tensor in tensors:
            if name not in expected or name in written:
                raise ValueError(f"write_streamed: {name!r} is {'repeated' if name in written else 'not an entry'}")
            if (tensor.dtype, tuple(tensor.shape)) != expected[name]:
                raise ValueError(f"write_streamed: {name} is {tensor.dtype} {tuple(tensor.shape)}, its entry "
                                 f"{expected[name][0]} {expected[name][1]}")
            # A copy: numpy() pins a storage's size, and the caller frees its bucket after this.
            data = tensor.detach().to("cpu", copy=True).contiguous().reshape(-1).view(torch.uint8).numpy()
            with archive.open(f"{_ARCHIVE}/data/{keys[name]}", "w", force_zip64=True) as record:
                record.write(memoryview(data))
            written.add(name)
        missing = [name for name in expected if name not in written]
        if missing:
            raise ValueError(f"write_streamed: no data for {', '.join(missing[:3])}")
        archive.writestr(f"{_ARCHIVE}/version", "3\n")


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s persistent buffers by state-dict key (what a state dict holds besides parameters)."""
    found = {}
    for prefix, sub in module.named_modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                found[f"{prefix}.{name}" if prefix else name] = buffer.detach().cpu().clone()
    return found


def stream_model(dp, path: str | Path | None) -> None:
    """The whole model's state dict of a replica with `shard="parameters"`, written to `path` on
    the rank given one (rank 0) as its buckets are gathered one at a time. A collective: every
    rank calls it, the others with None; a rank whose write fails still gathers every bucket, so
    its peers are not left waiting, then raises."""
    items = dp.sharding.params.stream()
    try:
        if path is not None:
            buffers = persistent_buffers(dp.module)
            entries = [(name, p.dtype, tuple(p.shape)) for name, p in dp.module.named_parameters()]
            entries += [(name, b.dtype, tuple(b.shape)) for name, b in buffers.items()]
            write_streamed(path, entries, itertools.chain(items, buffers.items()))
    finally:
        for _ in items:  # drain: the peers gather every bucket whatever happened here
            pass
