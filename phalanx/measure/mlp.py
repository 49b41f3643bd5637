"""The benchmark models by name: LeNet, the MLPs and the ResNet, all built by `phalanx.models`.

LeNet's gradient is 504 KB, so on gloo its allreduce is latency-bound (BASELINES.md); the MLP
784 -> 2048 -> 2048 -> 10 (`phalanx.models.mlp.WideMLP`, 5.8 M parameters, a 23 MB gradient)
has about 2.6x LeNet's FLOPs per image, so bandwidth and overlap decide its scaling. `bench
scaling` and `predict` time those two (`BENCH_MODELS`). `bench memory` adds `mlp-wide`, the same
MLP with 7168 hidden units (57.1 M parameters: 228 MB of float32 weights, 914 MB with gradients
and Adam's two moments, so the model's state outweighs the process's own ~300 MB), and the
reduced ResNet-18, whose BatchNorm every contender runs on its own rank's batch.
"""

from __future__ import annotations

from torch import nn

from phalanx.models import WideMLP, build_model

BENCH_MODELS = ("lenet", "mlp")
MEMORY_MODELS = (*BENCH_MODELS, "mlp-wide", "resnet")
WIDE_HIDDEN = 7168  # mlp-wide's hidden units: two layers of them hold 51 M of its 57.1 M parameters


def build_bench_model(name: str) -> nn.Module:
    """A model by name for 1x28x28 inputs and 10 classes (PyTorch's default init)."""
    if name == "mlp-wide":
        return WideMLP(hidden=WIDE_HIDDEN)
    if name in MEMORY_MODELS:
        return build_model(name)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MEMORY_MODELS)}")


__all__ = ["BENCH_MODELS", "MEMORY_MODELS", "WideMLP", "build_bench_model"]
