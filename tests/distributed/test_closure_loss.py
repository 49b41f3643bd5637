"""optimizer.step(closure) over a replica (guards/closure.py): LBFGS on 2 and 3 gloo workers steps as
on one device (float64, strong-Wolfe line search), whatever form of the loss the closure returns.

Before 2026-12-06 each rank's LBFGS searched its line with its own share of the loss: the ranks
stepped apart after the first step, then met in different collectives; without a line search the
state's `prev_loss` differed and close() stopped the run.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.data_parallel.guards.closure import UNSUMMED
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

N, STEPS = 24, 2


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 5, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 3, (N,), generator=g)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _lbfgs(world, returns: str, line_search: str | None = "strong_wolfe") -> dict:
    """Train STEPS LBFGS steps; on `world` (None: one device) the closure returns its loss as `returns` says:
    "share" (shard_loss's part), "summed" (phalanx.reduce(op="sum"): the global loss already), "mean" (a per-rank
    mean, with average=True). What the steps returned, how often the closure ran, the parameters."""
    x, y = _data()
    model = _model()
    dp = model if world is None else phalanx.prepare(model, world=world, average=True if returns == "mean" else None)
    rows = torch.arange(N) if world is None else phalanx.rank_shard(torch.arange(N), rank=world.rank,
                                                                    world_size=world.world_size)
    optimizer = torch.optim.LBFGS(model.parameters(), lr=1, max_iter=10, line_search_fn=line_search)
    calls = 0

    def closure():
        nonlocal calls
        calls += 1
        optimizer.zero_grad()
        if returns == "mean":
            loss = F.cross_entropy(dp(x[rows]), y[rows])
        else:
            loss = phalanx.shard_loss(F.cross_entropy(dp(x[rows]), y[rows], reduction="sum"), N)
        loss.backward()
        if world is not None:
            dp.finish_gradient_sync()
        return phalanx.reduce(loss, op="sum", world=world) if returns == "summed" and world is not None else loss

    losses = [float(optimizer.step(closure)) for _ in range(STEPS)]
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if world is not None:
        dp.close()
    return {"losses": losses, "calls": calls, "params": params}


def _worker(world, returns: str, line_search: str | None) -> dict:
    want, got = _lbfgs(None, returns, line_search), _lbfgs(world, returns, line_search)
    return {"calls": (got["calls"], want["calls"]),
            "param_error": ((got["params"] - want["params"]).abs().max() / want["params"].abs().max()).item(),
            "loss_error": max(abs(a - b) / abs(b) for a, b in zip(got["losses"], want["losses"])),
            "params": got["params"]}


@pytest.mark.parametrize("k,returns,line_search", [(2, "share", "strong_wolfe"), (3, "share", "strong_wolfe"),
                                                   (2, "summed", "strong_wolfe"), (2, "mean", "strong_wolfe"),
                                                   (2, "share", None)])
def test_lbfgs_steps_as_on_one_device(k, returns, line_search):
    results = run_workers(_worker, k, returns, line_search, timeout_s=120)
    for rank, result in enumerate(results):
        assert result["calls"][0] == result["calls"][1], (rank, result["calls"])
        assert result["param_error"] <= 1e-9, (rank, result["param_error"])
        assert result["loss_error"] <= 1e-12, (rank, result["loss_error"])  # the step returns the global loss
        assert torch.equal(result["params"], results[0]["params"]), rank  # one model, bit for bit


def _unsummed(world) -> str:
    x, y = _data()
    dp = phalanx.prepare(_model(), world=world)
    optimizer = torch.optim.LBFGS(dp.module.parameters(), max_iter=3)

    def closure():
        optimizer.zero_grad()
        loss = phalanx.shard_loss(F.cross_entropy(dp(x), y, reduction="sum"), N * world.world_size)
        loss.backward()  # and no dp.finish_gradient_sync()
        return loss

    try:
        optimizer.step(closure)
    except RuntimeError as exc:
        dp.finish_gradient_sync()
        dp.close()
        return str(exc)
    return "stepped"


def test_a_closure_that_never_sums_its_gradient_is_refused_as_it_returns():
    assert run_workers(_unsummed, 2, timeout_s=60) == [UNSUMMED, UNSUMMED]


def _sgd_closure(world, shard: str) -> tuple[float, float]:
    """SGD.step(closure) returns the closure's loss: on k ranks the global one, sharded or not."""
    x, y = _data()
    model = _model()
    dp = phalanx.prepare(model, world=world, **({"shard": shard} if shard != "none" else {}))
    optimizer = dp.optimizer(torch.optim.SGD, lr=0.1)
    rows = phalanx.rank_shard(torch.arange(N), rank=world.rank, world_size=world.world_size)

    def closure():
        optimizer.zero_grad()
        loss = phalanx.shard_loss(F.cross_entropy(dp(x[rows]), y[rows], reduction="sum"), N)
        loss.backward()
        dp.finish_gradient_sync()
        return loss

    got = optimizer.step(closure).item()
    dp.close()
    return got, F.cross_entropy(_model()(x), y).item()


@pytest.mark.parametrize("shard", ["none", "optimizer", "parameters"])
def test_the_loss_a_closure_step_returns_is_the_global_batchs(shard):
    for got, want in run_workers(_sgd_closure, 2, shard, timeout_s=60):
        assert got == pytest.approx(want, rel=1e-12)
