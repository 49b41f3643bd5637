"""Peak activation memory of a step, measured the same way on every device: what autograd saves.

`SavedTensorMeter` hooks `torch.autograd.graph.saved_tensors_hooks`: every tensor autograd keeps
for backward (inputs of convolutions and linear layers, ReLU outputs, ...) is counted when it is
packed and released when the graph that holds it is freed; tensors sharing one storage count
once, and parameters (held anyway) not at all. The peak over a step is its activation memory -
for a pipeline it grows with the micro-batches a stage holds at once (GPipe: all of them; 1F1B:
at most k - s). It counts CPU and GPU tensors alike, where `torch.cuda.max_memory_allocated`
would exist on GPUs only and include the allocator's slack.
"""

from __future__ import annotations

import torch


class _Packed:
    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: "SavedTensorMeter", key: int | None) -> None:
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self) -> None:
        if self.key is not None:
            self.meter.release(self.key)


class SavedTensorMeter:
    def __init__(self, parameters) -> None:
        self.excluded = {p.untyped_storage().data_ptr() for p in parameters}
        self.live_bytes = 0
        self.peak_bytes = 0
        self._refs: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self._hooks = None

    def _pack(self, tensor: torch.Tensor) -> _Packed:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.excluded or storage.nbytes() == 0:
            return _Packed(tensor, self, None)
        entry = self._refs.get(key)
        if entry is None:
            self._refs[key] = [1, storage.nbytes()]
            self.live_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        else:
            entry[0] += 1
        return _Packed(tensor, self, key)

    @staticmethod
    def _unpack(packed: _Packed) -> torch.Tensor:
        return packed.tensor

    def release(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live_bytes -= entry[1]
            del self._refs[key]

    def __enter__(self) -> "SavedTensorMeter":
        self.peak_bytes = self.live_bytes
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
