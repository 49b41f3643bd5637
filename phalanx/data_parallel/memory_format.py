"""CPU-first tensor layout: which memory format a replica's weights and activations use.

Convolutions on CPU run through oneDNN, whose fast kernels work on channels-last (NHWC) data;
with PyTorch's default NCHW layout every convolution reorders its tensors first. On these
machines LeNet's step (forward, backward, SGD) is about 1.5x faster once its weights are
channels_last, at 1 and 2 threads and at 128 to 512 images per step (measured interleaved,
torch 2.13 CPU). A DDP user gets NCHW unless they know to ask; phalanx picks channels_last by
default on CPU for models with 2-D convolutions. On CUDA the default stays contiguous: there
channels_last pays off mainly with tensor-core dtypes, which this trainer does not use.

The choice changes only the layout, never the values' meaning: gradients follow the weights'
layout (`buckets.grad_view`), and 1-device and k-device runs use the same format, so the exact
k-vs-1 equivalence still holds.
"""

from __future__ import annotations

import torch
from torch import nn

MEMORY_FORMATS = ("auto", "channels_last", "contiguous")


def resolve_memory_format(name: str, module: nn.Module, device: torch.device) -> torch.memory_format:
    """The format `name` means for `module` on `device`; `auto`: channels_last for CPU conv nets."""
    if name not in MEMORY_FORMATS:
        raise ValueError(f"unknown memory format {name!r}; choose one of {', '.join(MEMORY_FORMATS)}")
    if name == "channels_last":
        return torch.channels_last
    if name == "contiguous":
        return torch.contiguous_format
    has_conv = any(isinstance(m, nn.Conv2d) for m in module.modules())
    return torch.channels_last if device.type == "cpu" and has_conv else torch.contiguous_format


def apply_memory_format(module: nn.Module, memory_format: torch.memory_format) -> nn.Module:
    """Lay out `module`'s 4-D parameters and buffers in `memory_format` (in place); return it.

    Call before wrapping the module in DataParallel, which lays gradient buckets out to match.
    """
    if memory_format is torch.channels_last:
        module.to(memory_format=torch.channels_last)
    return module


def format_name(memory_format: torch.memory_format) -> str:
    return "channels_last" if memory_format is torch.channels_last else "contiguous"


def layout_of(module: nn.Module) -> str:
    """The memory format `module`'s 4-D parameters are laid out in: what a replica runs with."""
    for param in module.parameters():
        if param.dim() == 4 and not param.is_contiguous() and param.is_contiguous(memory_format=torch.channels_last):
            return "channels_last"
    return "contiguous"
