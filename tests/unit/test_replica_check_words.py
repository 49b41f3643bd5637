"""What the replica check says a drifting buffer is: a norm layer's statistics have phalanx's two
remedies (averaging, SyncBatchNorm); a buffer of one's own that a forward updates from the rank's
data has neither, and the line says to keep it equal by hand (before 2026-12-02 it named the two
remedies for any buffer, and neither does anything for a custom one: an outside-user trial)."""

from __future__ import annotations

import torch
from torch import nn

from phalanx.data_parallel import DataParallel
from phalanx.data_parallel.guards.checks import _buffer_cause
from phalanx.runtime.world import World

WORLD1 = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), backend="none",
               timeout_s=10.0)


class RunningNorm(nn.Module):
    """A normalizer of one's own: a running mean updated in training mode (as RL observation normalizers)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.running_mean.mul_(0.9).add_(x.mean(0).detach(), alpha=0.1)
        return x - self.running_mean


def test_a_norm_layers_statistics_and_a_buffer_of_ones_own_get_their_own_remedies():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), RunningNorm(4))
    norm = _buffer_cause(model, "1.running_mean")
    own = _buffer_cause(model, "2.running_mean")
    assert norm.startswith("a norm layer's statistics") and "average_running_stats=True" in norm
    assert own.startswith("a buffer the forward updates from each rank's own data, which phalanx leaves alone")
    assert "phalanx.allreduce(buffer, world=world)" in own and "average_running_stats" not in own
    with DataParallel(model, world=WORLD1) as dp:  # the replica names its module's buffers unprefixed
        assert _buffer_cause(dp, "1.running_mean") == norm and _buffer_cause(dp, "2.running_mean") == own
