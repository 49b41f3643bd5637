"""Reentrant activation checkpointing on 2 gloo workers with the exchange overlapped: a layer shared
by every checkpointed segment (ALBERT's habit) trains as on one device (float64, AdamW), sharded or
not. Before 2026-12-05 the first step stopped both ranks with "a gradient landed twice ... two
backwards with no forward between them"; DDP needs static_graph=True for it (overlap.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import phalanx
from tests.distributed.harness import run_workers
from tests.unit.test_reentrant_checkpoint import SharedAcrossSegments

pytestmark = pytest.mark.distributed

BATCH, STEPS = 12, 4


def _train(model, world=None, **options) -> dict:
    dp = phalanx.prepare(model, world=world, overlap=True, **options) if world is not None else model
    optimizer = dp.optimizer(torch.optim.AdamW, lr=0.05) if world is not None else \
        torch.optim.AdamW(model.parameters(), lr=0.05)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(BATCH, 16, generator=g, dtype=torch.float64, requires_grad=True)
        y = torch.randint(0, 3, (BATCH,), generator=g)
        rows = torch.arange(BATCH) if world is None else \
            phalanx.rank_shard(torch.arange(BATCH), rank=world.rank, world_size=world.world_size)
        optimizer.zero_grad()
        phalanx.shard_loss(F.cross_entropy(dp(x[rows]), y[rows], reduction="sum"), BATCH).backward()
        if world is not None:
            dp.finish_gradient_sync()
        optimizer.step()
    if world is None:
        return model.state_dict()
    state = dp.full_state_dict() if options.get("shard") else dp.state_dict()
    dp.close()
    return state


def _worker(world, shard: str) -> float:
    torch.manual_seed(0)
    want = _train(SharedAcrossSegments().double())
    torch.manual_seed(0)
    got = _train(SharedAcrossSegments().double(), world, **({"shard": shard} if shard != "none" else {}))
    return max(((got[k] - want[k]).abs().max() / want[k].abs().max()).item() for k in want)


@pytest.mark.parametrize("shard", ["none", "optimizer", "gradients", "parameters"])
def test_a_layer_shared_by_reentrant_checkpointed_segments_trains_as_on_one_device(shard):
    worst = run_workers(_worker, 2, shard, timeout_s=120)
    assert max(worst) <= 1e-12, worst
