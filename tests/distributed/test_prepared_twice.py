"""A model prepared twice on 2 ranks: refused in one line while the first replica is open; once it is
closed, the second trains as a model prepared once (float64, 1e-12 of one device).

A notebook cell `dp = phalanx.prepare(model, ...)` run twice, or a helper that prepares called twice,
left two replicas hooked on the same gradients: before 2026-12-05 every optimizer.step() on 2 ranks
was refused as "after a backward whose gradients were never summed across ranks: call
dp.finish_gradient_sync()", which the script did call (the older replica's were never summed).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

BATCH, STEPS = 8, 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _train(model: nn.Module, *, world=None) -> dict[str, torch.Tensor]:
    """STEPS of SGD with momentum on one device (`world` None) or as this rank's replica."""
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(STEPS):
        X = torch.randn(BATCH, 4, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 3, (BATCH,), generator=generator)
        rows = slice(None) if world is None else phalanx.rank_shard(torch.arange(BATCH), rank=world.rank,
                                                                     world_size=world.world_size)
        optimizer.zero_grad()
        phalanx.shard_loss(F.cross_entropy(model(X[rows]), y[rows], reduction="sum"), BATCH).backward()
        if world is not None:
            model.finish_gradient_sync()
        optimizer.step()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _prepared_twice(world) -> dict:
    model = _model()
    first = phalanx.prepare(model, world=world)
    try:
        phalanx.prepare(model, world=world)
        said = None
    except ValueError as exc:
        said = str(exc)
    first.close()
    again = phalanx.prepare(model, world=world)
    got = _train(again, world=world)
    again.close()
    want = _train(_model())
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    return {"said": said, "worst": worst}


def test_a_model_prepared_twice_is_refused_until_the_first_replica_is_closed():
    results = run_workers(_prepared_twice, 2, timeout_s=90)
    for rank, result in enumerate(results):
        assert result["said"] is not None and result["said"].startswith(
            "the model's parameter 0.weight is already exchanged by an open phalanx replica (made at "
            "test_prepared_twice.py:"), (rank, result["said"])
        assert "call its close() first" in result["said"]
        assert result["worst"] <= 1e-12, (rank, result["worst"])
