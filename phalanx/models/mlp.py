"""The wide MLP 784 -> 2048 -> 2048 -> 10: a model whose gradient is big enough for bandwidth to matter.

LeNet's gradient is 504 KB, so on gloo its allreduce is latency-bound (BASELINES.md); this MLP
has 5.8 M parameters (a 23 MB gradient) for about 2.6x LeNet's FLOPs per image, so bandwidth and
overlap decide its scaling. The benchmarks use it (`phalanx.measure.mlp`); it is registered as
`build_model("mlp")` so training, `verify` and `predict` can name it too.
"""

from __future__ import annotations

from torch import nn


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
