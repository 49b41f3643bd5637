"""Random draws in the step through `phalanx.BatchRandom`: 2 and 3 ranks equal one device, float64.

Each run trains the same model from the same seed on the same global batches (13 examples: shards
7+6 and 5+4+4), its step drawing as a diffusion model's does (a timestep and noise per sample),
as MAE masks (random scores sorted per sample) and through dropout (`nn.Dropout`, `nn.Dropout2d`)
routed by `route_dropout`. With the draws made through `BatchRandom` the k-rank runs end within
1e-12 of one device (3e-17 measured) and the replicas are bitwise equal; the same step drawing
from torch's own generator (the control, what a script does without it) ends 1e-1 away.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.data import split_batch
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

STEPS, GLOBAL_BATCH, T = 3, 13, 10


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.3), nn.Unflatten(1, (8, 4, 1)),
                         nn.Dropout2d(0.25), nn.Flatten(), nn.Linear(32, 3)).double()


def _train(world, routed: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    batches = [(torch.randn(GLOBAL_BATCH, 8, generator=generator, dtype=torch.float64),
                torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator)) for _ in range(STEPS)]
    torch.manual_seed(0)
    model = _model()
    draws = phalanx.BatchRandom(world=world, seed=3)
    if routed:
        assert draws.route_dropout(model) == 2
    with phalanx.prepare(model, world=world) as dp:
        optimizer = torch.optim.SGD(dp.parameters(), lr=0.3)
        for X, y in batches:
            xb, yb = split_batch(X, y, world.world_size)[world.rank]
            dp.zero_grad()
            with draws.batch(GLOBAL_BATCH):
                if routed:
                    t, noise, scores = draws.randint(0, T, (xb.shape[0],)), draws.randn_like(xb), draws.rand_like(xb)
                else:
                    t, noise, scores = torch.randint(0, T, (xb.shape[0],)), torch.randn_like(xb), torch.rand_like(xb)
                kept = torch.zeros_like(xb).scatter_(1, scores.argsort(1)[:, :6], 1.0)  # MAE: 6 of 8 features kept
                noisy = (xb + t[:, None].double() / T * noise) * kept
                loss = phalanx.shard_loss(F.cross_entropy(dp(noisy), yb, reduction="sum"), GLOBAL_BATCH)
            loss.backward()
            dp.finish_gradient_sync()
            optimizer.step()
        return torch.cat([p.detach().flatten() for p in dp.module.parameters()])


def _worker(world) -> dict:
    return {"routed": _train(world, routed=True), "torch": _train(world, routed=False)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_random_step_on_k_ranks_equals_one_device():
    one = run_workers(_worker, 1)[0]
    for k in (2, 3):
        ranks = run_workers(_worker, k, timeout_s=120)
        assert _rel(ranks[0]["routed"], one["routed"]) < 1e-12, k
        assert all(torch.equal(r["routed"], ranks[0]["routed"]) for r in ranks), k  # replicas identical
        assert _rel(ranks[0]["torch"], one["torch"]) > 1e-4, k  # the control: per-rank draws part ways
