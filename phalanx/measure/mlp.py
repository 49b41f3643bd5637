"""The benchmark models by name: LeNet and the wide MLP, both built by `phalanx.models`.

LeNet's gradient is 504 KB, so on gloo its allreduce is latency-bound (BASELINES.md); the MLP
784 -> 2048 -> 2048 -> 10 (`phalanx.models.mlp.WideMLP`, 5.8 M parameters, a 23 MB gradient)
has about 2.6x LeNet's FLOPs per image, so bandwidth and overlap decide its scaling. The
BatchNorm models stay out: their k-device step depends on the BatchNorm policy, not timed here.
"""

from __future__ import annotations

from torch import nn

from phalanx.models import WideMLP, build_model

BENCH_MODELS = ("lenet", "mlp")


def build_bench_model(name: str) -> nn.Module:
    """A model by name for 1x28x28 inputs and 10 classes (PyTorch's default init)."""
    if name in BENCH_MODELS:
        return build_model(name)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(BENCH_MODELS)}")


__all__ = ["BENCH_MODELS", "WideMLP", "build_bench_model"]
