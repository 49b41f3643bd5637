"""LeNet cut into the pieces the model-parallel splits place on devices (layers, channels).

The book's LeNet (`phalanx.models.LeNet`) is four *units*, each a weight layer and what follows
it up to the next weight layer: conv1 (+ReLU, avg-pool) -> 20x13x13, conv2 (+ReLU, avg-pool) ->
50x4x4, fc1 (+ReLU) -> 128, fc2 -> 10 logits. `--split layers` places contiguous runs of units
on the k devices (so k <= 4); `--split channels` splits every unit's output channels or units
(so k <= the narrowest layer, 10 for LeNet's classes). Multiply-accumulates per example (MACs)
drive the layer placement: conv2 alone is ~90% of LeNet's compute, which is why a pipeline of
LeNet is badly balanced whatever the cut - one of the chapter's reasons for splitting the data.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.errors import UsageError
from phalanx.models import LeNet

UNITS = ("conv1", "conv2", "fc1", "fc2")
INPUT_SHAPE = (1, 28, 28)


def unit_shapes(num_classes: int) -> dict[str, tuple[int, ...]]:
    """Each unit's output shape per example."""
    return {"conv1": (20, 13, 13), "conv2": (50, 4, 4), "fc1": (128,), "fc2": (num_classes,)}


def unit_macs(num_classes: int) -> dict[str, int]:
    """Forward multiply-accumulates per example (the convolutions' output pixels x kernel volume)."""
    return {"conv1": 26 * 26 * 20 * (1 * 3 * 3), "conv2": 9 * 9 * 50 * (20 * 5 * 5), "fc1": 800 * 128,
            "fc2": 128 * num_classes}


def apply_unit(name: str, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One unit's forward: LeNet.forward, written out per unit (the same ops, the same order)."""
    if name in ("conv1", "conv2"):
        return F.avg_pool2d(F.relu(layer(x)), kernel_size=2, stride=2)
    if name == "fc1":
        return F.relu(layer(x.flatten(1)))
    return layer(x)


def check_lenet(model: nn.Module, split: str) -> LeNet:
    if not isinstance(model, LeNet):
        raise UsageError(f"--split {split} is built for --model lenet, not {type(model).__name__}; "
                         "use --model lenet or --split data")
    return model


def stage_plan(num_devices: int, num_classes: int = 10) -> list[tuple[str, ...]]:
    """Contiguous runs of units, one per device, minimising the largest stage's MACs.

    Ties go to the cut that sends the fewest activation elements (a later cut: LeNet's
    activations shrink with depth). k = 4 is one unit per device.
    """
    if not 1 <= num_devices <= len(UNITS):
        raise UsageError(f"--split layers places LeNet's {len(UNITS)} layers ({', '.join(UNITS)}) on devices in order, "
                         f"so it needs 1 to {len(UNITS)} devices, not {num_devices}; use --devices {len(UNITS)} or fewer")
    macs, shapes = unit_macs(num_classes), unit_shapes(num_classes)
    best = None
    for cuts in itertools.combinations(range(1, len(UNITS)), num_devices - 1):
        bounds = (0, *cuts, len(UNITS))
        stages = [UNITS[a:b] for a, b in zip(bounds, bounds[1:])]
        sent = sum(math.prod(shapes[s[-1]]) for s in stages[:-1])
        key = (max(sum(macs[u] for u in s) for s in stages), sent)
        if best is None or key < best[0]:
            best = (key, stages)
    return best[1]


def channel_counts(total: int, num_devices: int) -> list[int]:
    """Output channels (units) per device: sizes differ by at most one, larger first (as split_batch)."""
    base, extra = divmod(total, num_devices)
    return [base + 1] * extra + [base] * (num_devices - extra)


def check_channel_split(num_devices: int, num_classes: int = 10) -> None:
    """Every device must own at least one output channel of every layer."""
    narrowest = min(shape[0] for shape in unit_shapes(num_classes).values())
    if not 1 <= num_devices <= narrowest:
        raise UsageError(f"--split channels gives every device at least one output channel of every layer, and "
                         f"LeNet's narrowest layer has {narrowest} (fc2, one per class), so it needs 1 to "
                         f"{narrowest} devices, not {num_devices}; use --devices {narrowest} or fewer")

