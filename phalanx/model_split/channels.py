"""`--split channels`: every LeNet layer's output channels (units) split over k devices.

As the original AlexNet did on two GPUs, each device holds a slice of every layer: rows
[start, stop) of each weight (a conv's output channels, a linear layer's output units) and of
its bias, so 1/k of the parameters (uneven slices differ by one, larger first: LeNet's 50 and 10
over 4 devices are 13,13,12,12 and 3,3,2,2). Each device computes its channels of a layer for
the whole global batch, applies the layer's ReLU and pooling (per channel, so they need no
communication), and the shards are gathered into the next layer's input (channels_comm.py). The
last gather yields the logits on every device; every device computes the same loss, rank 0
counts it.

Exact: a device's channels are computed from the whole input with the whole kernel, so the
forward is the 1-device forward; the weight gradient of a slice is the 1-device weight gradient
of those rows; input gradients are summed over devices (up to summation order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.comm.counting import CountingTransport
from phalanx.model_split.channels_comm import ChannelComm, gather_channels
from phalanx.model_split.lenet_parts import UNITS, apply_unit, channel_counts, check_channel_split, check_lenet
from phalanx.model_split.model_split import ModelSplit
from phalanx.runtime.world import World


def _slice_layer(layer: nn.Module, start: int, stop: int) -> nn.Module:
    """A copy of `layer` that computes only output channels (units) [start, stop)."""
    if isinstance(layer, nn.Conv2d):
        part = nn.Conv2d(layer.in_channels, stop - start, layer.kernel_size, stride=layer.stride, padding=layer.padding)
    else:
        part = nn.Linear(layer.in_features, stop - start)
    part = part.to(layer.weight.dtype)
    with torch.no_grad():
        part.weight.copy_(layer.weight[start:stop])
        part.bias.copy_(layer.bias[start:stop])
    return part


class ChannelShard(nn.Module):
    """This device's slice of every LeNet layer, under LeNet's names."""

    def __init__(self, full_model: nn.Module, bounds: dict[str, tuple[int, int]]) -> None:
        super().__init__()
        for name in UNITS:
            setattr(self, name, _slice_layer(getattr(full_model, name), *bounds[name]))


class ChannelSplit(ModelSplit):
    name = "channels"

    def __init__(self, full_model: nn.Module, *, world: World, num_classes: int = 10,
                 transport: CountingTransport | None = None) -> None:
        check_lenet(full_model, "channels")
        check_channel_split(world.world_size, num_classes)
        super().__init__(world=world, full_model=full_model, transport=transport)
        k, rank = world.world_size, world.rank
        self.counts = {name: channel_counts(getattr(full_model, name).weight.shape[0], k) for name in UNITS}
        self.bounds = {name: (sum(c[:rank]), sum(c[:rank + 1])) for name, c in self.counts.items()}
        self.module = ChannelShard(full_model, self.bounds).to(world.device)
        self.comm = ChannelComm(world=world, transport=self.transport)
        self.holds_output = world.is_main

    def layout(self) -> str:
        counts = ", ".join(f"{name} {'/'.join(map(str, c))}" for name, c in self.counts.items())
        return f"output channels split over {self.world.world_size} device(s) [{counts}]"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in UNITS:
            local = apply_unit(name, getattr(self.module, name), x)
            # The logits' gradient is the same on every device; every other gathered tensor feeds
            # a split layer, whose input gradient is a partial sum.
            x = gather_channels(local, comm=self.comm, counts=self.counts[name], reduce=name != UNITS[-1])
        return x

    def forward_backward(self, X, y, *, global_batch_size):
        logits = self.forward(X)
        loss_sum = F.cross_entropy(logits, y, reduction="sum")
        (loss_sum / global_batch_size).backward()
        out_loss, out_correct = self.output_tensors()
        if self.holds_output:
            out_loss += loss_sum.detach()
            out_correct += (logits.argmax(dim=1) == y).sum()
        return out_loss, out_correct

    @torch.no_grad()
    def predict(self, X):
        logits = self.forward(X)
        return logits if self.holds_output else None

    def assemble(self, shards):
        return {key: torch.cat([shard[key] for shard in shards], dim=0) for key in shards[0]}

    def load_full_state_dict(self, state):
        self.module.load_state_dict({key: value[slice(*self.bounds[key.split(".")[0]])] for key, value in state.items()})
