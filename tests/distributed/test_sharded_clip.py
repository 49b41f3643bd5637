"""Clipping a sharded replica's gradients: phalanx's exact, torch's own over its parameters refused.

After `finish_gradient_sync()` a sharded replica holds the summed gradient only over each rank's
range; torch's `clip_grad_norm_(dp.parameters(), max)` computed each rank's own norm at stage 1
(0.41 / 0.43 against one device's 0.44, the parameters 1.6e-2 off) and 0 at stages 2 and 3
(`.grad` is None: nothing clipped, 0.40 off), and `clip_grad_value_` failed inside torch. Now both
are one line naming `phalanx.clip_grad_norm_(dp, max_norm)` / `phalanx.clip_grad_value_(dp,
clip_value)`; the value clip equals one device's at every stage (2 workers, float64).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx

pytestmark = pytest.mark.distributed

STEPS, ROWS, CLIP_VALUE = 4, 12, 0.02


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _value_clipped_and_torch_refusals(shard: str) -> tuple[float, list[str]]:
    torch.set_default_dtype(torch.float64)
    world = phalanx.init()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(STEPS, ROWS, 5, generator=g), torch.randint(0, 3, (STEPS, ROWS), generator=g)
    one = _model()
    one_optimizer = torch.optim.SGD(one.parameters(), lr=0.5, momentum=0.9)
    dp = phalanx.prepare(_model(), world=world, shard=shard)
    optimizer = dp.optimizer(torch.optim.SGD, lr=0.5, momentum=0.9)
    mine = phalanx.rank_shard(torch.arange(ROWS), rank=world.rank, world_size=world.world_size)
    refusals = []
    for step in range(STEPS):
        one_optimizer.zero_grad()
        F.cross_entropy(one(x[step]), y[step], reduction="sum").div(ROWS).backward()
        torch.nn.utils.clip_grad_value_(one.parameters(), CLIP_VALUE)
        one_optimizer.step()
        optimizer.zero_grad()
        phalanx.shard_loss(F.cross_entropy(dp(x[step][mine]), y[step][mine], reduction="sum"), ROWS).backward()
        dp.finish_gradient_sync()
        for torch_clip in (lambda: torch.nn.utils.clip_grad_norm_(dp.parameters(), 0.1),
                           lambda: torch.nn.utils.clip_grad_value_(dp.module.parameters(), CLIP_VALUE)):
            try:
                torch_clip()
            except phalanx.UsageError as exc:
                refusals.append(str(exc))
        phalanx.clip_grad_value_(dp, CLIP_VALUE)
        optimizer.step()
    whole = dp.full_state_dict() if shard == "parameters" else dp.module.state_dict()
    dp.close()
    worst = max(float((whole[k] - v).abs().max()) for k, v in one.state_dict().items())
    return worst, refusals


@pytest.mark.parametrize("shard", ["optimizer", "gradients", "parameters"])
def test_value_clip_is_one_devices_and_torchs_clip_over_the_shards_is_one_line(shard):
    results = phalanx.launch(_value_clipped_and_torch_refusals, shard, devices="cpu:2", timeout_s=120, quiet=True)
    for worst, refusals in results:
        assert worst <= 1e-12, f"{worst:.3g} from one device's clip_grad_value_"
        assert len(refusals) == 2 * STEPS, refusals
        norm, value = refusals[:2]
        assert norm.startswith(f"torch.nn.utils.clip_grad_norm_ over a replica with shard={shard!r}") \
            and "use phalanx.clip_grad_norm_(dp, max_norm) after dp.finish_gradient_sync()" in norm, norm
        assert "use phalanx.clip_grad_value_(dp, clip_value)" in value and "\n" not in norm + value, value
