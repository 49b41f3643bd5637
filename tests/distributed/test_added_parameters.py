"""A layer added to the model after `prepare`, on 2 gloo workers: refused on both ranks in one line
at the next `dp.zero_grad()` (or, with the optimizer's `zero_grad`, at the sync), where before each
rank trained its own copy of it (0.014 relative off one device after 2 SGD steps, and replicas
apart, silently). Prepared again as the line says, the grown model equals one device (float64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

BATCH = 24


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _grow(model: nn.Module) -> None:
    torch.manual_seed(1)
    model.append(nn.Linear(3, 3).double())


def _steps(model, finish, rows, zero_grad, count: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(2)
    for _ in range(count):
        X, y = torch.randn(BATCH, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (BATCH,), generator=g)
        zero_grad(model, optimizer)
        phalanx.shard_loss(F.cross_entropy(model(X[rows]), y[rows], reduction="sum"), BATCH).backward()
        finish()
        optimizer.step()


def _refused(world, zeroing: str) -> str:
    dp = phalanx.prepare(_model(), world=world)
    rows = phalanx.rank_shard(torch.arange(BATCH), rank=world.rank, world_size=world.world_size)
    zero_grad = (lambda m, o: m.zero_grad()) if zeroing == "replica" else (lambda m, o: o.zero_grad())
    _steps(dp, dp.finish_gradient_sync, rows, zero_grad, 1)
    _grow(dp.module)
    try:
        _steps(dp, dp.finish_gradient_sync, rows, zero_grad, 1)
    except phalanx.UsageError as exc:
        return str(exc)
    finally:
        dp.close()
    return "not refused"


def _prepared_again(world) -> float:
    reference = _model()
    every = torch.arange(BATCH)
    _steps(reference, lambda: None, every, lambda m, o: o.zero_grad(), 2)
    _grow(reference)
    _steps(reference, lambda: None, every, lambda m, o: o.zero_grad(), 2)
    dp = phalanx.prepare(_model(), world=world)
    rows = phalanx.rank_shard(every, rank=world.rank, world_size=world.world_size)
    _steps(dp, dp.finish_gradient_sync, rows, lambda m, o: m.zero_grad(), 2)
    model = dp.module
    _grow(model)
    dp.close()
    dp = phalanx.prepare(model, world=world)
    _steps(dp, dp.finish_gradient_sync, rows, lambda m, o: m.zero_grad(), 2)
    worst = max(((a - b).abs().max() / b.abs().max()).item()
                for a, b in zip(dp.module.parameters(), reference.parameters()))
    dp.close()
    return worst


@pytest.mark.parametrize("zeroing", ["replica", "optimizer"])
def test_a_layer_added_after_prepare_is_refused_on_every_rank(zeroing):
    said = run_workers(_refused, 2, zeroing)
    assert said[0] == said[1] and said[0].startswith("parameter 3.weight was added to the model after prepare"), said


def test_prepared_again_the_grown_model_equals_one_device():
    assert max(run_workers(_prepared_again, 2)) < 1e-12
