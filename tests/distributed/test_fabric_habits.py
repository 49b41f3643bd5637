"""A Fabric script's loop, ported line by line as docs/accelerate-fabric.md's Fabric table says, on
2 gloo processes against 1, float64: Fabric's accumulation habit, `with
fabric.no_backward_sync(model, enabled=accumulating):` around every micro-batch, ported as
`with dp.no_sync(enabled=accumulating):`, ends with the 1-process weights (before 2026-12-03
`no_sync` took no `enabled=`: a TypeError at the first micro-batch)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

ACCUMULATE, GLOBAL_BATCH = 2, 16


def _dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    X = torch.randn(75, 6, generator=g, dtype=torch.float64)  # 5 global batches: the last step has one micro-batch
    return torch.utils.data.TensorDataset(X, (X[:, :3].sum(1) > 0).long())


def _fabric_port(world) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)                                            # fabric.seed_everything(0)
    dataset = _dataset()
    loader = phalanx.ShardedLoader(dataset, world=world, global_batch_size=GLOBAL_BATCH, seed=0)
    dp = phalanx.prepare(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)), world=world,
                         dtype="float64")                           # fabric.setup(model, optimizer)
    optimizer = torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(2):
        batches = list(loader.epoch(epoch))
        for i, ((x, y), global_size) in enumerate(batches):
            first = i - i % ACCUMULATE
            step_size = sum(size for _, size in batches[first:first + ACCUMULATE])  # the step's global batch
            accumulating = (i + 1) % ACCUMULATE != 0 and i + 1 < len(batches)
            with dp.no_sync(enabled=accumulating):                  # fabric.no_backward_sync(model, enabled=...)
                loss_sum = F.cross_entropy(dp(x), y, reduction="sum")
                phalanx.shard_loss(loss_sum, step_size).backward()  # fabric.backward(loss)
            assert dp.sync_enabled                                  # the switch comes back after the block
            if not accumulating:
                dp.finish_gradient_sync()
                phalanx.clip_grad_norm_(dp, 1.0)                    # fabric.clip_gradients(model, optimizer, 1.0)
                optimizer.step()
                optimizer.zero_grad()
    state = {name: t.detach().clone() for name, t in dp.state_dict().items()}
    dp.close()
    return state


def test_fabric_accumulation_port_on_two_ranks_equals_one():
    one = run_workers(_fabric_port, 1, timeout_s=120)[0]
    two = run_workers(_fabric_port, 2, timeout_s=120)
    for name, want in one.items():
        assert torch.equal(two[0][name], two[1][name]), name
        assert torch.allclose(two[0][name], want, rtol=0, atol=1e-12), (name, (two[0][name] - want).abs().max())
