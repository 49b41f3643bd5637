"""The wide MLP 784 -> 2048 -> 2048 -> 10: a model whose gradient is big enough for bandwidth to matter.

LeNet's gradient is 504 KB, so on gloo its allreduce is latency-bound (~1.5 ms, as for 4 KB); this MLP
has 5.8 M parameters (a 23 MB gradient) for about 2.6x LeNet's FLOPs per image, so bandwidth and
overlap decide its scaling. The benchmarks use it (`phalanx.measure.mlp`); it is registered as
`build_model("mlp")` so training, `verify` and `predict` can name it too.
"""

from __future__ import annotations

from torch import nn


class WideMLP(nn.Module):
    """`depth` hidden layers of `hidden` units (the default, 2 x 2048, is `build_model("mlp")`)."""

    def __init__(self, *, in_features: int = 28 * 28, hidden: int = 2048, depth: int = 2, num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(hidden, hidden), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.net(x)
