"""The benchmark models by name: LeNet, the MLPs and the ResNet, all built by `phalanx.models`.

LeNet's gradient is 504 KB, so on gloo its allreduce is latency-bound (~1.5 ms, as for 4 KB); the MLP
784 -> 2048 -> 2048 -> 10 (`phalanx.models.mlp.WideMLP`, 5.8 M parameters, a 23 MB gradient)
has about 2.6x LeNet's FLOPs per image, so bandwidth and overlap decide its scaling. `bench
scaling` and `predict` time those two (`BENCH_MODELS`). `bench memory` adds `mlp-wide`, the MLP
784 -> 4 x 4096 -> 10 (53.6 M parameters: 214 MB of float32 weights, 858 MB with gradients and
Adam's two moments, so the model's state outweighs the process's own ~300 MB; its largest
layer holds 31% of them, as a many-layer model's does; one 7168 x 7168 layer holding 90% would
leave any sharding that one whole gradient to hold at once), and the reduced ResNet-18, whose
BatchNorm every contender runs on its own rank's batch.
"""

from __future__ import annotations

from torch import nn

from phalanx.models import WideMLP, build_model

BENCH_MODELS = ("lenet", "mlp")
MEMORY_MODELS = (*BENCH_MODELS, "mlp-wide", "resnet")
WIDE_HIDDEN, WIDE_DEPTH = 4096, 4  # mlp-wide: 3 of its 4 hidden layers hold 16.8 M parameters each


def build_bench_model(name: str) -> nn.Module:
    """A model by name for 1x28x28 inputs and 10 classes (PyTorch's default init)."""
    if name == "mlp-wide":
        return WideMLP(hidden=WIDE_HIDDEN, depth=WIDE_DEPTH)
    if name in MEMORY_MODELS:
        return build_model(name)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MEMORY_MODELS)}")


__all__ = ["BENCH_MODELS", "MEMORY_MODELS", "WideMLP", "build_bench_model"]
