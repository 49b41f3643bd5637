"""A small ResNet for 1x28x28 images: D2L's ResNet-18 for Fashion-MNIST, reduced to run on a CPU.

D2L's "Training on Multiple GPUs" concise implementation (13.6) trains a ResNet-18 whose stem is
a 3x3 convolution (stride 1, no max-pool, since the images are only 28x28), followed by four
stages of residual blocks (Residual, section 8.6: conv 3x3, BN, ReLU, conv 3x3, BN, plus the
input - through a 1x1 convolution where the shape changes - then ReLU), global average pooling
and one linear layer. That network has 11 M parameters. Here the widths are a quarter (16, 32,
64, 128 instead of 64 ... 512) and each stage has one block instead of two: 28 -> 28 -> 14 -> 7
-> 4 spatially, about 0.31 M parameters and ~13 M multiply-adds per image forward (LeNet: ~2 M).
"""

from __future__ import annotations

from typing import Sequence

from torch import nn


class Residual(nn.Module):
    """D2L's residual block; `stride > 1` or a change of width adds the 1x1 shortcut convolution."""

    def __init__(self, in_channels: int, out_channels: int, *, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, stride=stride)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = None
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride)
        self.relu = nn.ReLU()

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.relu(y + (x if self.shortcut is None else self.shortcut(x)))


class ResNet(nn.Module):
    def __init__(
        self,
        *,
        num_classes: int = 10,
        in_channels: int = 1,
        widths: Sequence[int] = (16, 32, 64, 128),
        blocks_per_stage: int = 1,
    ) -> None:
        super().__init__()
        if not widths or blocks_per_stage < 1:
            raise ValueError(f"need at least one stage and one block per stage, got {widths}, {blocks_per_stage}")
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], kernel_size=3, padding=1), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        blocks = []
        previous = widths[0]
        for stage, width in enumerate(widths):
            for block in range(blocks_per_stage):
                # As D2L's resnet_block: the first stage keeps the resolution, later ones halve it.
                stride = 2 if stage > 0 and block == 0 else 1
                blocks.append(Residual(previous, width, stride=stride))
                previous = width
        self.stages = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(previous, num_classes)

    def forward(self, x):
        x = self.stages(self.stem(x))
        return self.fc(self.pool(x).flatten(1))
