"""The global batches a verification runs on, and fingerprints of what each rank actually saw.

Data comes in one of three forms: a pair of tensors `(inputs, targets)` (or anything with
`train_images` / `train_labels`, like `phalanx.data.ImageDataset`), sampled in global batches of
`global_batch_size` with phalanx's own epoch order (`global_batches`, a pure function of seed and
epoch); or a picklable `batches_fn(step) -> (inputs, targets)` that returns the global batch of a
step. Either way every rank draws the same global batch and reads its contiguous shard
(`shard_bounds`), exactly as `phalanx train` does. `example_digests` fingerprints every example
a rank received, so the parent can check that the k shards put together are the 1-device batch
instead of assuming it.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import torch

from phalanx.data import EpochBatches, to_float
from phalanx.verify.config import VerifyConfig

Batch = tuple[torch.Tensor, torch.Tensor]


def check_data(data: Any) -> None:
    """Refuse data in a form no run can use, before any process starts (ValueError)."""
    if callable(data):
        return
    pair = _as_pair(data)
    if pair is None:
        raise ValueError(f"data must be (inputs, targets) tensors, a dataset with train_images/train_labels, "
                         f"or a batches_fn(step) -> (inputs, targets); got {type(data).__name__}")
    inputs, targets = pair
    if inputs.shape[0] != targets.shape[0] or inputs.shape[0] == 0:
        raise ValueError(f"data has {inputs.shape[0]} inputs and {targets.shape[0]} targets; "
                         "give the same, non-zero number of each")


def _as_pair(data: Any) -> Batch | None:
    if hasattr(data, "train_images") and hasattr(data, "train_labels"):
        return data.train_images, data.train_labels
    if isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(t, torch.Tensor) for t in data):
        return data[0], data[1]
    return None


class BatchSource:
    """Global batch of each step, converted to the run's dtype and device, trimmed if asked."""

    def __init__(self, data: Any, config: VerifyConfig, *, device: torch.device, seed_offset: int = 0) -> None:
        # seed_offset != 0 only for the planted data-order bug: this rank draws its own order.
        self._fn: Callable[[int], Batch] | None = data if callable(data) else None
        self._pair = None if self._fn is not None else _as_pair(data)
        self._config = config
        self._device = device
        self._epochs: dict[int, list[torch.Tensor]] = {}
        if self._pair is not None:
            self._schedule = EpochBatches(num_examples=self._pair[0].shape[0],
                                          global_batch_size=config.global_batch_size,
                                          seed=config.seed + seed_offset)

    def raw(self, step: int) -> Batch:
        """The step's global batch as given (before dtype conversion), trimmed if configured."""
        if self._fn is not None:
            inputs, targets = self._fn(step)
        else:
            epoch, index = divmod(step, self._schedule.steps_per_epoch)
            if epoch not in self._epochs:
                self._epochs = {epoch: self._schedule.epoch(epoch)}
            indices = self._epochs[epoch][index]
            inputs, targets = self._pair[0][indices], self._pair[1][indices]
        if inputs.shape[0] != targets.shape[0]:
            raise ValueError(f"step {step + 1}: batch has {inputs.shape[0]} inputs but {targets.shape[0]} targets")
        multiple = self._config.trim_to_multiple
        if multiple is not None:
            keep = inputs.shape[0] - inputs.shape[0] % multiple
            if keep == 0:
                raise ValueError(f"step {step + 1}: a batch of {inputs.shape[0]} cannot be trimmed to a multiple of "
                                 f"{multiple}; use a larger batch")
            inputs, targets = inputs[:keep], targets[:keep]
        return inputs, targets

    def batch(self, step: int) -> Batch:
        inputs, targets = self.raw(step)
        return prepare_inputs(inputs, self._config.torch_dtype).to(self._device), targets.to(self._device)


def prepare_inputs(inputs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 images -> [0, 1] (as phalanx train), other floats -> the run's dtype, ints unchanged."""
    if inputs.dtype == torch.uint8:
        return to_float(inputs, dtype)
    if inputs.is_floating_point():
        return inputs.to(dtype)
    return inputs


def example_digests(inputs: torch.Tensor, targets: torch.Tensor) -> list[str]:
    """One 64-bit fingerprint per example (its input and target bytes), in batch order."""
    x = inputs.detach().cpu().contiguous().reshape(inputs.shape[0], -1).view(torch.uint8) if inputs.numel() else None
    t = targets.detach().cpu().contiguous().reshape(targets.shape[0], -1).view(torch.uint8) if targets.numel() else None
    digests = []
    for i in range(inputs.shape[0]):
        h = hashlib.blake2b(digest_size=8)
        if x is not None:
            h.update(x[i].numpy().tobytes())
        if t is not None:
            h.update(t[i].numpy().tobytes())
        digests.append(h.hexdigest())
    return digests


def tensors_digest(tensors: list[torch.Tensor]) -> str:
    """One fingerprint of a list of tensors' values (replicas must agree bit for bit)."""
    h = hashlib.blake2b(digest_size=12)
    for tensor in tensors:
        h.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
