"""The benchmark models: LeNet from `phalanx.models`, and a wide MLP where communication matters.

LeNet's gradient is 504 KB, so on gloo its allreduce is latency-bound (BASELINES.md); the MLP
784 -> 2048 -> 2048 -> 10 has 5.8 M parameters (a 23 MB gradient) for about 2.6x LeNet's FLOPs
per image, so bandwidth and overlap decide its scaling. It lives here, not in `phalanx.models`,
because nothing but the benchmarks uses it.
"""

from __future__ import annotations

from torch import nn

from phalanx.models import MODELS, build_model

BENCH_MODELS = tuple(dict.fromkeys(MODELS + ("mlp",)))


class WideMLP(nn.Module):
    def __init__(self, *, in_features: int = 28 * 28, hidden: int = 2048, num_classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x):
        return self.net(x)


def build_bench_model(name: str) -> nn.Module:
    """A model by name for 1x28x28 inputs and 10 classes; `phalanx.models` wins a shared name."""
    if name in MODELS:
        return build_model(name)
    if name == "mlp":
        return WideMLP()
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(BENCH_MODELS)}")
