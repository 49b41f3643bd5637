"""A user's gradient hooks on a replica (2 gloo workers, float64, SGD with momentum, 3 steps).

`register_hook` (before accumulation) and `register_post_accumulate_grad_hook` registered before
`prepare` act on each rank's own share before it lands, as under DDP: a linear one (halving)
equals one device. A post-accumulate hook registered after `prepare` runs after the bucket noted
its landing, so its write is refused at the sync like a clip before it; the line now names such
a hook and where to register it (before 2026-12-03 it named torch's clip alone).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.data import split_batch
from phalanx.errors import UsageError
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed
GLOBAL, STEPS = 13, 3


def _halve(param: nn.Parameter) -> None:
    param.grad.mul_(0.5)


def _model(when: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    if when == "before":
        model[0].weight.register_post_accumulate_grad_hook(_halve)
        model[2].weight.register_hook(lambda grad: grad * 3)
    return model


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(GLOBAL, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (GLOBAL,), generator=g))
            for _ in range(STEPS)]


def _worker(world, when: str, overlap: bool):
    dp = phalanx.prepare(_model(when), world=world, overlap=overlap)
    if when == "after":
        dp.module[0].weight.register_post_accumulate_grad_hook(_halve)
    optimizer = torch.optim.SGD(dp.module.parameters(), lr=0.1, momentum=0.9)
    try:
        for X, y in _batches():
            X_shard, y_shard = split_batch(X, y, world.world_size)[world.rank]
            dp.zero_grad()
            phalanx.shard_loss(F.cross_entropy(dp(X_shard), y_shard, reduction="sum"), GLOBAL).backward()
            dp.finish_gradient_sync()
            optimizer.step()
    except UsageError as error:
        return str(error)
    state = {k: v.clone() for k, v in dp.module.state_dict().items()}
    dp.close()
    return state


@pytest.mark.parametrize("overlap", [False, True])
def test_gradient_hooks_before_prepare_equal_one_device_and_a_writing_hook_after_is_named(overlap):
    model = _model("before")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for X, y in _batches():
        optimizer.zero_grad()
        (F.cross_entropy(model(X), y, reduction="sum") / GLOBAL).backward()
        optimizer.step()
    for got in run_workers(_worker, 2, "before", overlap, timeout_s=120):
        for name, value in model.state_dict().items():
            torch.testing.assert_close(got[name], value, rtol=1e-12, atol=1e-14, msg=name)
    for said in run_workers(_worker, 2, "after", overlap, timeout_s=120):
        assert isinstance(said, str) and " were written in place between backward and finish_gradient_sync()" in said
        assert said.endswith("(a register_post_accumulate_grad_hook that writes p.grad: register it before prepare, so "
                             "it writes each rank's share before it lands, as under DDP)"), said
