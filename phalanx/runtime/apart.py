"""Ranks that train apart under `phalanx run`: said once, after the script's first optimizer step.

A script that opens a process group and never wraps its model (no DistributedDataParallel, no
phalanx.prepare) trains k separate models, each on its own part of the data, and nothing fails:
torchrun says nothing, the loss falls, and the checkpoint rank 0 writes is one of k models.
PyTorch's own ImageNet example (pytorch/examples imagenet/main.py) does so on the CPU: its DDP wrap
sits in the GPU branch. phalanx's replica compares itself across ranks; a bare model has nobody.

`watch_ranks_apart` puts one pre- and one post-hook on torch's process-wide optimizer step. At each
optimizer's first step, with a group of more than one rank open, each rank takes an exact
fingerprint of that optimizer's parameters before and after, and of the gradients it reads (per
tensor: its shape and the integer sum of its bits), and leaves them in the launcher's store, under
its own key; rank 0 reads the peers' without waiting (a store `check` at its later steps; at the
script's end at most `END_WAIT_S`) and compares. Equal after the step (DDP, Horovod, anything that
sums gradients): silent. Apart while every shape matches: one PhalanxWarning on rank 0, at the
script's line of that step, saying whether they were equal before it with gradients that differed
(not summed), equal before it with gradients alike (the step read something that differs between
the ranks: an lr set from the rank, a scheduler stepped on rank 0 only), or already apart (each
rank's own initialisation, nothing broadcast). Keys carry the restart count, so a restarted run compares
its own steps.

The same record carries, per DistributedSampler (or DataLoader with one) that the script's frames
hold at that step, by variable name, its dataset's length and a CRC of its Subset indices: the
sampler shards one dataset by rank itself, so a `random_split` drawn after a per-rank seed
(`torch.manual_seed(seed + rank)`, for augmentation) has every rank read its shard of another
split, and some examples train on one rank while validating on another. DDP's models stay equal,
so nothing else shows it; rank 0 names the sampler and the fix once (`sampler_line`).

A script that never joins the job's group (no phalanx.init(), no init_process_group) runs k whole
copies of the run: rank 0 says so at its first optimizer step, without any store.

What is not a bare model is left alone: a step inside another optimizer's step (ZeRO's and local
SGD's inner optimizers), parameters that are views or tensor subclasses (phalanx's and DeepSpeed's
shards, FSDP's flat parameters, DTensors), any shape that differs between ranks (a pipeline, a
shard), and scripts that imported DeepSpeed or Megatron. Ranks meant to differ with whole,
equal-shaped models (local SGD by hand, an ensemble, a search per rank) get the warning once; it
says so, and `warnings.filterwarnings("ignore", category=phalanx.PhalanxWarning)` silences it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from phalanx.data.item_identity import subset_checksum
from phalanx.data.loader import samplers_in_frames
from phalanx.errors import PhalanxWarning, frame_values, script_frame, script_line

KEY = "phalanx/apart"
END_WAIT_S = 1.0  # at the script's end, how long rank 0 waits for a peer's first fingerprint
# Libraries whose ranks hold different parts in plain, equal-shaped tensors (ZeRO's flat partitions, tensor
# parallelism); torch's own FSDP and DTensor are imported with torch.distributed, so they are told by type.
SHARDING_MODULES = ("deepspeed", "megatron")
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(params: list[torch.Tensor]) -> list[list[int]]:
    """Per tensor `[*shape, bit_sum]`: exact, so any difference between ranks shows (one host read)."""
    sums = []
    for param in params:
        flat = param.detach().reshape(-1)
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        ints = flat.view(_BITS[flat.element_size()]) if flat.is_floating_point() else flat
        sums.append(ints.sum(dtype=torch.int64) if ints.numel() else torch.zeros((), dtype=torch.int64))
    total = torch.stack([s.to(sums[0].device) for s in sums]).tolist() if sums else []  # one read from a GPU
    return [[*param.shape, value] for param, value in zip(params, total)]


def _whole_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor] | None:
    """The optimizer's parameters, or None where they are not a bare model's (module docstring)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params or any(type(p) not in (torch.Tensor, torch.nn.Parameter) or p._is_view() for p in params):
        return None
    return params


@dataclass
class _First:
    """One optimizer's first step, as this rank saw it: where the script called it, and its fingerprint."""

    ordinal: int
    where: tuple[str, int, str]  # errors.script_line's (file, line, note)
    before: list[list[int]] | None = None
    grads: list[list[int]] | None = None  # the gradients the step read (a None one: empty)
    samplers: dict[str, list[int]] = field(default_factory=dict)  # sampler_datasets at the step
    data_parallel: str = ""  # data_parallel_note at the step (rank 0's)


def sampler_datasets(frame) -> dict[str, list[int]]:
    """By variable name, each DistributedSampler (or DataLoader with one) in the locals of `frame`
    and the frames above it, or in the script's globals: [its dataset's length, its Subset CRC]."""
    found: dict[str, list[int]] = {}
    for name, sampler in samplers_in_frames(frame):
        if name not in found:
            with contextlib.suppress(TypeError):  # a dataset without a length: nothing to compare
                found[name] = [len(sampler.dataset), subset_checksum(sampler.dataset)]
    return found


@dataclass
class ApartWatch:
    """The hooks' state on one worker (see the module docstring); `close()` removes them."""

    rank: int
    workers: int = 1  # the launcher's WORLD_SIZE
    firsts: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    pending: list[tuple[Any, _First, int]] = field(default_factory=list)  # (store, first, world size): rank 0's
    depth: int = 0  # optimizer steps running now: one inside another is a wrapper's inner optimizer
    said: bool = False
    handles: list = field(default_factory=list)

    def before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.depth += 1
        if self.depth == 1 and self.rank == 0 and self.workers > 1 and not self.said and not _joined():
            self.said = True  # the first step of a script that never joined: every worker trains alone
            path, line_number, note = script_line(sys._getframe())
            warnings.warn_explicit(alone_line(self.workers) + data_parallel_note(sys._getframe()) + note, PhalanxWarning,
                                   path, line_number)
        if self.depth > 1 or optimizer in self.firsts or not _group_open() or _capturing():
            return
        frame = script_frame(sys._getframe())
        first = self.firsts[optimizer] = _First(ordinal=len(self.firsts), where=script_line(frame))
        if not any(name in sys.modules for name in SHARDING_MODULES):
            params = _whole_params(optimizer)
            if params is not None:
                first.samplers = sampler_datasets(frame)
                first.data_parallel = data_parallel_note(frame) if self.rank == 0 else ""
                first.before = fingerprint(params)
                first.grads = fingerprint([torch.zeros(0) if p.grad is None else p.grad for p in params])

    def after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.depth = max(self.depth - 1, 0)
        first = self.firsts.get(optimizer)
        if self.depth == 0 and first is not None and first.before is not None:
            prints = {"before": first.before, "grads": first.grads, "after": fingerprint(_whole_params(optimizer) or []),
                      "samplers": first.samplers}
            first.before = first.grads = None  # published once
            self._publish(first, prints)
        if self.rank == 0 and self.pending:
            self.compare(wait_s=0.0)

    def _publish(self, first: _First, prints: dict) -> None:
        try:
            store, world_size = dist.distributed_c10d._get_default_store(), dist.get_world_size()
            store.set(_key(first.ordinal, self.rank), json.dumps(prints))
        except (RuntimeError, ValueError):  # a group without a store of torch's: nothing to compare through
            return
        if self.rank == 0:
            self.pending.append((store, first, world_size))

    def compare(self, *, wait_s: float) -> None:
        """Rank 0: each first step whose fingerprints every rank has left, compared; the rest kept."""
        still = []
        for store, first, world_size in self.pending:
            keys = [_key(first.ordinal, rank) for rank in range(world_size)]
            try:
                if wait_s > 0:
                    store.wait(keys, datetime.timedelta(seconds=wait_s))
                elif not store.check(keys):
                    still.append((store, first, world_size))
                    continue
                prints = [json.loads(store.get(key)) for key in keys]
            except (RuntimeError, ValueError):  # a peer that never got there, or a store already gone
                continue
            line = apart_line(prints, first.data_parallel) or sampler_line(prints)
            if line is not None and not self.said:  # at the script's line, so the script's filters apply
                self.said = True
                path, line_number, note = first.where
                warnings.warn_explicit(line + note, PhalanxWarning, path, line_number)
        self.pending = still

    def finish(self) -> None:
        """At the script's successful end: rank 0's last comparison, waiting at most END_WAIT_S."""
        if self.rank == 0 and self.pending:
            self.compare(wait_s=END_WAIT_S)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _capturing() -> bool:
    """A step recorded into a CUDA graph: nothing may be read from the device (its eager steps are watched)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _key(ordinal: int, rank: int) -> str:
    """Where `rank` leaves its fingerprints of the `ordinal`-th optimizer's first step, in this attempt."""
    return f"{KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{ordinal}/{rank}"


def _joined() -> bool:
    return dist.is_available() and dist.is_initialized()


def _group_open() -> bool:
    return _joined() and dist.get_world_size() > 1


def data_parallel_note(frame) -> str:
    """What the script's torch.nn.DataParallel, held in `frame` or the frames above it, does not do
    across processes ("" where none): the book's concise implementation, one process's GPUs only."""
    name = next((name for name, value in frame_values(frame) if isinstance(value, torch.nn.DataParallel)), None)
    return "" if name is None else (
        f"; `{name}` is a torch.nn.DataParallel, which splits each batch over the GPUs of one process and sums nothing "
        "across processes (the book's concise implementation): put phalanx.prepare(model) in its place")


def alone_line(workers: int) -> str:
    """What rank 0 says at an optimizer step taken before the script joined the job's process group."""
    return (f"this optimizer step ran before the script joined the job's process group, so each of the {workers} "
            "workers trains alone, a whole run of its own: call phalanx.init() (or "
            "torch.distributed.init_process_group()) before training, and wrap the model (model = "
            "phalanx.prepare(model)) so the workers split each batch and sum their gradients")


def apart_line(prints: list[dict], wrapper: str = "") -> str | None:
    """The one line for every rank's first-step fingerprints (rank order), or None when they agree
    or are not the same model (a shape differs); `wrapper`: data_parallel_note's, said where no
    gradient was summed."""
    ours = prints[0]
    if any(len(p["after"]) != len(ours["after"]) or any(a[:-1] != b[:-1] for a, b in zip(p["after"], ours["after"]))
           for p in prints[1:]):
        return None
    apart = [(rank, sum(a != b for a, b in zip(p["after"], ours["after"]))) for rank, p in enumerate(prints)]
    apart = [(rank, count) for rank, count in apart if count]
    if not apart:
        return None
    rank, count = apart[0]
    started = all(p["before"] == ours["before"] for p in prints[1:])
    summed = all(p["grads"] == ours["grads"] for p in prints[1:])  # the gradients the step read: alike
    others = f" and {len(apart) - 1} more rank{'s' * (len(apart) > 2)}" if len(apart) > 1 else ""
    said = (f"after this first optimizer step the {len(prints)} ranks hold different models "
            f"(rank {rank}'s parameters differ from rank 0's in {count} of {len(ours['after'])} tensors{others}): ")
    meant = "if the ranks are meant to differ (local SGD, an ensemble), filter this PhalanxWarning out"
    if started and summed:
        return (f"{said}they were equal before it and so were their gradients, so the step itself read something "
                "that differs between the ranks: an optimizer setting changed on some ranks only (an lr set from the "
                "rank, a scheduler stepped under `if rank == 0:`) or a value each rank computed from its own data; "
                f"make it alike on every rank; {meant}")
    how = ("they were equal before it and apart after it: no gradient was summed across the ranks" if started
           else "they were apart before it too (each rank its own initialisation: nothing broadcast rank 0's)"
                + ("" if summed else " and no gradient was summed across the ranks"))
    return (f"{said}{how}, so each rank trains its own model on its part of the data; wrap the model before the "
            "optimizer (model = phalanx.prepare(model), or DistributedDataParallel(model), without device_ids on "
            f"the CPU){wrapper}; {meant}")


def sampler_line(prints: list[dict]) -> str | None:
    """The one line for a DistributedSampler whose dataset differs between the ranks (`prints`: every
    rank's first-step record, rank order), or None where every sampler rank 0 holds agrees."""
    ours = prints[0].get("samplers", {})
    for rank, theirs in enumerate(prints[1:], 1):
        for name, (size, crc) in theirs.get("samplers", {}).items():
            if name not in ours or [size, crc] == ours[name]:
                continue
            said = (f"the DistributedSampler of `{name}` shards a different dataset on each rank (rank {rank}'s ")
            if size != ours[name][0]:
                return (f"{said}has {size} examples, rank 0's {ours[name][0]}): it shards one dataset by rank itself, "
                        "so a dataset each rank cut to its own part first trains on 1/k of it; hand the sampler the "
                        "whole dataset on every rank")
            return (f"{said}Subset holds other indices than rank 0's): it shards one dataset by rank itself, so a "
                    "dataset each rank cut to its own part (Subset(data, range(rank, n, k))) trains on 1/k of it, and "
                    "a random_split drawn from each rank's own random numbers (after torch.manual_seed(seed + rank)) "
                    "on shards of other splits, some examples on one rank while another validates on them; make the "
                    "same split on every rank (random_split(data, lengths, generator=torch.Generator()."
                    "manual_seed(0))) and hand the sampler all of it")
    return None


def watch_ranks_apart(*, rank: int, workers: int = 1) -> ApartWatch:
    """Install the hooks for this worker (`workers`: the launcher's WORLD_SIZE); `close()` them when the script ends."""
    watch = ApartWatch(rank=rank, workers=workers)
    watch.handles = [register_optimizer_step_pre_hook(watch.before_step),
                     register_optimizer_step_post_hook(watch.after_step)]
    return watch
