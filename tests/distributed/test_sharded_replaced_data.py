"""A parameter's `.data` replaced after `prepare(shard="optimizer" | "gradients")` is refused.

Stages 1 and 2 make each parameter a view of one flat buffer: the sharded optimizer steps this
rank's range of it and the all-gather after the step fills the rest. `param.data = new` (weight
surgery, an init written after wrapping) cuts the parameter loose: its values stayed as set while
the flat buffer trained on unseen (2 gloo workers, float64, SGD with momentum, 4 steps: 0.013
relative off one device under shard="optimizer", exit 0). Unsharded replicas train it exactly.
Now every rank stops at its first step naming the parameter and the fix (copy the values in).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.errors import UsageError
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed


def _worker(world, shard: str) -> str:
    torch.manual_seed(0)
    dp = phalanx.prepare(nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)), world=world, dtype="float64",
                         shard=shard)
    dp.module[0].weight.data = torch.ones(6, 4, dtype=torch.float64)  # the same on every rank
    optimizer = dp.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.randint(0, 3, (3,))
    optimizer.zero_grad()
    phalanx.shard_loss(F.cross_entropy(dp(x), y, reduction="sum"), 6).backward()
    dp.finish_gradient_sync()
    try:
        optimizer.step()
    except UsageError as error:
        return str(error)
    finally:
        dp.close()
    return "trained on"


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_replaced_data_is_refused_under_stages_1_and_2(shard):
    for said in run_workers(_worker, 2, shard, timeout_s=120):
        assert said.startswith("0.weight.data was replaced after prepare(shard=...): the parameter no longer lies "
                               "in the flat buffer the sharded optimizer steps, so it would not train; copy the "
                               "values in instead (with torch.no_grad(): param.copy_(new))"), said
