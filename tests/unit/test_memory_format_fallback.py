"""`memory_format="auto"` falls back to contiguous for a forward that `.view()`s a conv output.

The PyTorch tutorial's CNN flattens with `x.view(x.size(0), -1)`, which a channels_last
activation cannot take. Under `auto` the replica's first forward is a trial (format_fallback.py):
on that error its buffers and generators are put back, the weights laid out contiguous, and the
forward runs again, so a float64 model with BatchNorm and dropout before the view trains exactly
as plain torch does. An explicit channels_last keeps failing, with phalanx's one line.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.data_parallel.format_fallback import ChannelsLastView
from phalanx.runtime.world import World

GLOBAL_BATCH, STEPS = 6, 3


class TutorialNet(nn.Module):
    """pytorch.org's "Training a classifier" CNN, with BatchNorm and dropout before its view."""

    def __init__(self, dropout: float = 0.3, batchnorm: bool = True) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 4, 3), nn.Conv2d(4, 6, 3)
        self.bn = nn.BatchNorm2d(4) if batchnorm else nn.Identity()
        self.pool, self.drop, self.fc = nn.MaxPool2d(2, 2), nn.Dropout(dropout), nn.Linear(6 * 2 * 2, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.bn(self.conv1(x))))
        x = self.drop(self.pool(F.relu(self.conv2(x))))
        x = x.view(x.size(0), -1)
        return self.fc(x)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(GLOBAL_BATCH, 3, 16, 16, generator=g, dtype=torch.float64),
             torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)) for _ in range(STEPS)]


def plain_torch(dropout: float = 0.3) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = TutorialNet(dropout).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches():
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(world: World, memory_format: str = "auto", dropout: float = 0.3) -> dict:
    torch.manual_seed(0)
    dp = phalanx.prepare(TutorialNet(dropout), world=world, dtype="float64", memory_format=memory_format)
    before = dp.choices.describe()
    optimizer = torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9)
    mine = phalanx.rank_shard(torch.arange(GLOBAL_BATCH), rank=world.rank, world_size=world.world_size)
    for x, y in batches():
        optimizer.zero_grad()
        loss = F.cross_entropy(dp(x[mine]), y[mine], reduction="sum")
        phalanx.shard_loss(loss, GLOBAL_BATCH).backward()
        dp.finish_gradient_sync()
        optimizer.step()
    state = {k: v.detach().clone() for k, v in dp.state_dict().items()}
    described = dp.choices.describe()
    dp.close()
    return {"state": state, "before": before, "describe": described}


def one_device() -> World:
    return World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
                 backend="none", timeout_s=10.0)


def max_difference(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max((got[k].double() - want[k].double()).abs().max().item() for k in want)


def test_auto_falls_back_to_contiguous_and_trains_as_plain_torch():
    got = train(one_device())
    assert ", channels_last, float64" in got["before"]  # chosen before anything ran
    assert ", contiguous (the model's forward .view()s a conv output), float64" in got["describe"], got["describe"]
    # BatchNorm's statistics and num_batches_tracked, and dropout's generator, put back after the failed try.
    assert max_difference(got["state"], plain_torch()) < 1e-12
    assert int(got["state"]["bn.num_batches_tracked"]) == STEPS


def test_a_forward_that_takes_channels_last_keeps_it():
    class Flattens(TutorialNet):
        def forward(self, x):
            x = self.pool(F.relu(self.bn(self.conv1(x))))
            return self.fc(self.drop(self.pool(F.relu(self.conv2(x)))).flatten(1))

    dp = phalanx.prepare(Flattens(), world=one_device(), dtype="float64")
    dp(batches()[0][0])
    assert ", channels_last, float64" in dp.choices.describe()
    assert dp.module.conv1.weight.is_contiguous(memory_format=torch.channels_last)


def test_explicit_channels_last_names_reshape_and_contiguous():
    dp = phalanx.prepare(TutorialNet(), world=one_device(), dtype="float64", memory_format="channels_last")
    with pytest.raises(ChannelsLastView) as caught:
        dp(batches()[0][0])
    line = str(caught.value)
    assert "\n" not in line
    assert line == ("the model's forward .view()s a conv output that is channels_last (memory_format=\"channels_last\" "
                    "lays it out so), which torch cannot view as one block: flatten with .reshape(x.size(0), -1) or "
                    "x.flatten(1), or prepare with memory_format=\"contiguous\"")
    assert isinstance(caught.value, RuntimeError)  # what torch's error was
