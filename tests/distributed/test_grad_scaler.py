"""The float16 recipe's GradScaler on 2 gloo workers (float64, a CPU scaler): unscale_ after
`finish_gradient_sync()` ends within 1e-12 of one device (with and without overlap, with a clip
between unscale_ and step); unscale_ before it is refused on both ranks in one line. Before the
refusal it was silent: with overlap the unscale raced the exchange and the parameters ended ~50x
their size away from one device; without, the sum was right but each rank looked for inf in its
own share only (guards/unscale.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.data_parallel.guards.unscale import UnscaleBeforeSync
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

BATCH, STEPS = 64, 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 3)).double()


def _train(model, finish, rows) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        X, y = torch.randn(BATCH, 16, generator=g, dtype=torch.float64), torch.randint(0, 3, (BATCH,), generator=g)
        model.zero_grad()
        scaler.scale(phalanx.shard_loss(F.cross_entropy(model(X[rows]), y[rows], reduction="sum"), BATCH)).backward()
        finish()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # on the summed, unscaled gradient
        scaler.step(optimizer)
        scaler.update()


def _after_the_sync(world, overlap: bool) -> float:
    reference = _model()
    _train(reference, lambda: None, torch.arange(BATCH))
    dp = phalanx.prepare(_model(), world=world, overlap=overlap, bucket_cap_mb=0.02)
    _train(dp, dp.finish_gradient_sync, phalanx.rank_shard(torch.arange(BATCH), rank=world.rank,
                                                            world_size=world.world_size))
    worst = max(((a - b).abs().max() / b.abs().max()).item()
                for a, b in zip(dp.module.parameters(), reference.parameters()))
    dp.close()
    return worst


def _before_the_sync(world, overlap: bool) -> str:
    dp = phalanx.prepare(_model(), world=world, overlap=overlap, bucket_cap_mb=0.02)
    try:
        _train(dp, lambda: None, phalanx.rank_shard(torch.arange(BATCH), rank=world.rank, world_size=world.world_size))
    except UnscaleBeforeSync as exc:
        dp.finish_gradient_sync()  # the exchange the refused step left, so both ranks close alike
        return str(exc)
    finally:
        dp.close()
    return "not refused"


@pytest.mark.parametrize("overlap", [True, False])
def test_unscale_after_the_sync_equals_one_device(overlap):
    assert max(run_workers(_after_the_sync, 2, overlap)) < 1e-12


@pytest.mark.parametrize("overlap", [True, False])
def test_unscale_before_the_sync_is_refused_on_every_rank(overlap):
    said = run_workers(_before_the_sync, 2, overlap)
    assert said[0] == said[1] and said[0].startswith("scaler.unscale_(optimizer) (or scaler.step, which calls it) "
                                                     "before dp.finish_gradient_sync()"), said


def _overflow_in_one_range(world, stage: str) -> tuple[float, float, float]:
    """Step 2's gradient overflows in the last layer's bias alone, which one rank's range holds:
    one device skips that step; every rank must skip it too, and keep the same scale."""
    overflow = [False]

    def model() -> nn.Module:
        built = _model()
        built[4].bias.register_hook(lambda g: g * float("inf") if overflow[0] else g)
        return built

    def train(net, make_optimizer, finish, rows) -> torch.amp.GradScaler:
        optimizer = make_optimizer(net)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1)
        g = torch.Generator().manual_seed(1)
        for step in range(STEPS):
            X, y = torch.randn(BATCH, 16, generator=g, dtype=torch.float64), torch.randint(0, 3, (BATCH,), generator=g)
            overflow[0] = step == 1
            net.zero_grad()  # dp.zero_grad() keeps the pieces' gradients: unscale_ sees each rank's range
            scaler.scale(phalanx.shard_loss(F.cross_entropy(net(X[rows]), y[rows], reduction="sum"), BATCH)).backward()
            finish()
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
        return scaler

    reference = model()
    one = train(reference, lambda net: torch.optim.Adam(net.parameters(), lr=0.01), lambda: None, torch.arange(BATCH))
    dp = phalanx.prepare(model(), world=world, shard=stage)
    scaler = train(dp, lambda net: net.optimizer(torch.optim.Adam, lr=0.01), dp.finish_gradient_sync,
                   phalanx.rank_shard(torch.arange(BATCH), rank=world.rank, world_size=world.world_size))
    state = dp.full_state_dict()
    worst = max(((state[k] - v).abs().max() / v.abs().max()).item() for k, v in reference.state_dict().items())
    dp.close()
    return worst, scaler.get_scale(), one.get_scale()


@pytest.mark.parametrize("stage", ["optimizer", "gradients", "parameters"])
def test_an_overflow_in_one_ranks_range_is_skipped_on_every_rank_under_sharding(stage):
    # Before 2026-12-04 each rank's unscale_ looked at its own range only: the rank holding the
    # bias skipped the step and halved its scale while the other stepped, into the all-gather after
    # the step alone (stages 1 and 2: "ranks are in different collectives"; stage 3, whose step has
    # no collective: silently 0.31 relative off one device; guards/unscale.py's agree_on_overflow).
    results = run_workers(_overflow_in_one_range, 2, stage, timeout_s=120)
    assert max(worst for worst, _, _ in results) < 1e-12, results
    assert all(scale == one for _, scale, one in results) and results[0][1] == results[1][1], results
