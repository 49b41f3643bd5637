"""The three ways the chapter weighs to spread one network over k devices, by name.

`data` (phalanx's DataParallel: full replicas, split batches, summed gradients), `layers`
(pipeline.py: stages of layers, micro-batches pipelined) and `channels` (channels.py: every
layer's output channels split). `check_split` refuses, before any process starts, a k or a
micro-batch count the split cannot use; `build_split` makes this rank's share of a model for
the two model-parallel splits.
"""

from __future__ import annotations

from torch import nn

from phalanx.comm.counting import CountingTransport
from phalanx.errors import UsageError
from phalanx.model_split.channels import ChannelSplit
from phalanx.model_split.lenet_parts import check_channel_split, stage_plan
from phalanx.model_split.model_split import ModelSplit
from phalanx.model_split.pipeline import SCHEDULES, Pipeline
from phalanx.runtime.world import World

SPLITS = ("data", "layers", "channels")


def check_split(split: str, *, model: str, num_devices: int, micro_batches: int | None, global_batch_size: int,
                num_classes: int = 10) -> None:
    """UsageError (one line, naming the fix) for a split these devices, model or batch cannot run."""
    if split not in SPLITS:
        raise UsageError(f"--split {split!r} is unknown; choose one of {', '.join(SPLITS)}")
    if micro_batches is not None and split != "layers":
        raise UsageError("--micro-batches applies to --split layers only; drop it or use --split layers "
                         "(data parallelism cuts micro-batches with --grad-accum)")
    if split == "data":
        return
    if model != "lenet":
        raise UsageError(f"--split {split} is built for --model lenet, not {model}; use --model lenet or --split data")
    if split == "channels":
        check_channel_split(num_devices, num_classes)
        return
    stage_plan(num_devices, num_classes)
    if micro_batches is not None and not 1 <= micro_batches <= global_batch_size:
        raise UsageError(f"--micro-batches {micro_batches} must be between 1 and the global batch ({global_batch_size}); "
                         "use e.g. --micro-batches 4")


def default_micro_batches(num_devices: int, global_batch_size: int) -> int:
    """2k (GPipe's bubble, (k-1)/(M+k-1), is then at most a third), or the batch size if smaller."""
    return min(2 * num_devices, global_batch_size)


def build_split(split: str, full_model: nn.Module, *, world: World, global_batch_size: int,
                micro_batches: int | None = None, schedule: str = "gpipe", num_classes: int = 10,
                transport: CountingTransport | None = None) -> ModelSplit:
    """This rank's share of `full_model` (the same initial model on every rank) for `layers`/`channels`."""
    if split == "layers":
        count = default_micro_batches(world.world_size, global_batch_size) if micro_batches is None else micro_batches
        return Pipeline(full_model, world=world, micro_batches=count, schedule=schedule, num_classes=num_classes,
                        transport=transport)
    if split == "channels":
        return ChannelSplit(full_model, world=world, num_classes=num_classes, transport=transport)
    raise ValueError(f"build_split makes the model-parallel splits (layers, channels), not {split!r}")


__all__ = ["SPLITS", "SCHEDULES", "check_split", "default_micro_batches", "build_split"]
