"""What a training worker holds in memory: the bytes of its tensors, and its resident set.

Two measurements, both read in the worker itself (`bench memory`):

- **Held bytes** of parameters, gradients and optimizer state, from the tensors a rank really
  holds after its steps, never from a formula: every distinct storage reached from them counted
  once at its allocated size (`storage_bytes`), so a view (phalanx's parameters and gradients are
  views of flat buffers) adds nothing, a storage freed to zero bytes (stage 3's buffers at rest)
  counts nothing, and a DTensor (FSDP2) counts its local shard. ZeroRedundancyOptimizer's state
  is its local optimizer's (its `.optim`), the partition this rank updates. What no reachable
  tensor points at (DDP's reducer buckets, FSDP2's all-gather buffers, autograd's saved
  activations) is not in these columns; it is in the resident set.
- **Resident set** from /proc/self/status: `VmRSS` now, `VmHWM` the peak. `MemoryProbe` notes
  the RSS before the model is built, the peak up to the end of the set-up, then resets the peak
  (/proc/self/clear_refs, Linux 4.0+) so that the peak over the steps is read on its own; it also
  notes that peak after the first `EARLY_STEPS` steps, so a peak that keeps growing with the
  steps (heap fragmentation: a tensor kept per step pinned the allocator's holes, 0.7 -> 1.4-2.1
  GB in 100 steps) shows as the gap between the two. Off Linux every RSS is None.
"""

from __future__ import annotations

import sys
from typing import Iterable

import torch

from phalanx.data_parallel import DataParallel

HELD = ("parameters", "gradients", "optimizer_state")  # the columns of held bytes, in order
EARLY_STEPS = 5  # the steps after which the early peak is read: what bench memory timed before it ran 20


def _status_bytes(field: str) -> int | None:
    """A `kB` field of /proc/self/status in bytes (None off Linux)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_bytes() -> int | None:
    """This process's resident set now (VmRSS)."""
    return _status_bytes("VmRSS")


def peak_rss_bytes() -> int | None:
    """This process's peak resident set since it started or since `reset_peak_rss` (VmHWM)."""
    return _status_bytes("VmHWM")


def reset_peak_rss() -> bool:
    """Set the peak back to the resident set now; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (None skipped; a DTensor's local shard)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        tensor = _local(tensor)
        storage = tensor.untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's parameters and state), any other tensor as it is. DTensor's
    package is looked up, not imported (0.4 s): where nothing imported it, no DTensor exists. It is
    torch.distributed.tensor's from torch 2.5, and torch.distributed._tensor's in 2.4."""
    for package in ("torch.distributed.tensor", "torch.distributed._tensor"):
        dtensor = getattr(sys.modules.get(package), "DTensor", None)
        if dtensor is not None and isinstance(tensor, dtensor):
            return tensor.to_local()
    return tensor


def held_bytes(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer, *,
               grads: Iterable[torch.Tensor] = ()) -> dict[str, int]:
    """{"parameters", "gradients", "optimizer_state"}: bytes held through `params` (and the
    optimizer's own parameters), their `.grad`s and `grads`, and the optimizer's state."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: its local optimizer's
    params = list(params) + [p for group in inner.param_groups for p in group["params"]]
    state = [value for per_param in inner.state.values() for value in per_param.values()
             if isinstance(value, torch.Tensor)]
    return {"parameters": storage_bytes(params),
            "gradients": storage_bytes([p.grad for p in params] + list(grads)),
            "optimizer_state": storage_bytes(state)}


def replica_held_bytes(dp: DataParallel, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """`held_bytes` of a phalanx replica: its parameters with the flat buffers and shard copies
    of a sharded one, its gradient buckets (unsharded and stage 1: where the gradients live;
    stages 2-3: freed at rest) and shard gradients."""
    params, grads = list(dp.module.parameters()), [bucket.buffer for bucket in dp.buckets]
    if dp.sharding is not None:
        params += dp.sharding.params.buffers + dp.sharding.params.shard
        grads += dp.sharding.shard_grads
    return held_bytes(params, optimizer, grads=grads)


class MemoryProbe:
    """A worker's resident set around its run: made first thing in the worker (the RSS before any
    model), `built()` once the contender is set up (its peak so far, then the peak reset),
    `stepped()` after each step (the peak after `EARLY_STEPS` of them), `finished(held)` after the
    steps (the steps' peak, and the held bytes)."""

    def __init__(self) -> None:
        self.record: dict = {"rss_before_model_bytes": rss_bytes()}
        self._steps = 0  # steps since the set-up

    def built(self) -> None:
        self.record["setup_peak_rss_bytes"] = peak_rss_bytes()
        self.record["peak_reset"] = reset_peak_rss()

    def stepped(self) -> None:
        self._steps += 1
        if self._steps == EARLY_STEPS and self.record.get("peak_reset"):
            self.record["early_steps_peak_rss_bytes"] = peak_rss_bytes()

    def finished(self, held: dict[str, int]) -> dict:
        steps_peak = peak_rss_bytes() if self.record.get("peak_reset") else None
        setup_peak = self.record.get("setup_peak_rss_bytes")
        whole = peak_rss_bytes() if steps_peak is None else max(steps_peak, setup_peak or 0)
        early = self.record.get("early_steps_peak_rss_bytes", steps_peak)  # fewer steps: all of them are early
        return {**self.record, "early_steps_peak_rss_bytes": early, "steps_peak_rss_bytes": steps_peak,
                "peak_rss_bytes": whole, "held_bytes": dict(held)}
