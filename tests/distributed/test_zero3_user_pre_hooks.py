"""Stage 3 gathers a layer's parameters before the layer's own forward pre-hooks read them.

`torch.nn.utils.prune` (like any forward pre-hook a user registered before `prepare`) computes
`weight = weight_orig * weight_mask` in a forward pre-hook. Under `shard="parameters"` the gather
was a pre-hook appended after it, so prune's ran first on this rank's empty range and every rank
stopped at the first forward with "a.weight_orig cannot be read or written between steps"
(unsharded, stages 1 and 2, and prune applied after prepare all trained exactly). The gather is
now the first pre-hook: 2 gloo workers, float64, SGD with momentum, equal torch alone to 1e-12.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import prune

import phalanx
from phalanx.data import split_batch
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed
GLOBAL, STEPS = 13, 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    prune.l1_unstructured(model[0], "weight", amount=0.3)  # weight_orig, weight_mask and a pre-hook
    return model


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(GLOBAL, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (GLOBAL,), generator=g))
            for _ in range(STEPS)]


def _worker(world) -> dict:
    dp = phalanx.prepare(_model(), world=world, shard="parameters")
    optimizer = dp.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
    for X, y in _batches():
        X_shard, y_shard = split_batch(X, y, world.world_size)[world.rank]
        optimizer.zero_grad()
        phalanx.shard_loss(F.cross_entropy(dp(X_shard), y_shard, reduction="sum"), GLOBAL).backward()
        dp.finish_gradient_sync()
        optimizer.step()
    state = dp.full_state_dict()
    dp.close()
    return state


def test_a_pruned_model_trains_under_stage_3_as_on_one_device():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for X, y in _batches():
        optimizer.zero_grad()
        (F.cross_entropy(model(X), y, reduction="sum") / GLOBAL).backward()
        optimizer.step()
    want = model.state_dict()
    for got in run_workers(_worker, 2, timeout_s=120):
        assert set(got) == set(want)
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=1e-12, atol=1e-14, msg=name)
    assert (want["0.weight_orig"] - _model().state_dict()["0.weight_orig"]).abs().max() > 1e-3  # the steps moved it
