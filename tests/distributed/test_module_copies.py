"""A deep copy of a prepared replica's module (an EMA through torch's `AveragedModel`, a teacher, a
snapshot) works on 2 gloo workers and is not a replica: the copy keeps none of the replica's
hooks (on its parameters and module) and shares the world (which its SyncBatchNorm holds). It
failed on every rank before, with the replica's own "cannot be copied" TypeError, on the very
call that error recommends. The copy's own forward and backward start no exchange, and the
replica still trains as one device does (float64, overlap on and off, against plain SGD on the
whole batch)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.data_parallel.replica_hook import _ignored
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)).double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (16,), generator=g)


def _worker(world, overlap: bool) -> dict:
    dp = phalanx.prepare(_model(), world=world, overlap=overlap)
    ema = torch.optim.swa_utils.AveragedModel(dp.module)
    teacher = copy.deepcopy(dp.module)
    optimizer = torch.optim.SGD(dp.parameters(), lr=0.1)
    x, y = _data()
    mine = phalanx.rank_shard(torch.arange(16), rank=world.rank, world_size=world.world_size)
    for _ in range(3):
        optimizer.zero_grad()
        phalanx.shard_loss(F.cross_entropy(dp(x[mine]), y[mine], reduction="sum"), 16).backward()
        dp.finish_gradient_sync()
        optimizer.step()
        ema.update_parameters(dp.module)
    teacher.eval()  # its running statistics are its own: evaluate it alone, on any rank
    F.cross_entropy(teacher(x), y).backward()  # the copy's backward: nobody's exchange
    out = {"params": torch.cat([p.detach().reshape(-1) for p in dp.module.parameters()]),
           "ema": torch.cat([p.detach().reshape(-1) for p in ema.module.parameters()]),
           # Every hook the copy holds is the no-op a ReplicaHook copies to, none the replica's.
           "replica's hooks on the copy": [repr(h) for p in teacher.parameters()
                                           for h in (p._post_accumulate_grad_hooks or {}).values()
                                           if h is not _ignored]
                                          + [repr(h) for h in teacher._forward_pre_hooks.values() if h is not _ignored],
           "copied hooks": sum(len(p._post_accumulate_grad_hooks or {}) for p in teacher.parameters())
                           + len(teacher._forward_pre_hooks),
           "shares world": teacher[1].world is world}
    dp.close()
    return out


def _one_device() -> torch.Tensor:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    for _ in range(3):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("overlap", [True, False])
def test_a_copied_module_is_not_a_replica(overlap):
    results = run_workers(_worker, 2, overlap, timeout_s=120)
    want = _one_device()
    assert results[0]["copied hooks"] > 0  # rank 0's first-step look sat on the module when it was copied
    for out in results:
        assert (out["params"] - want).abs().max().item() <= 1e-12
        assert out["replica's hooks on the copy"] == []
        assert out["shares world"]  # its SyncBatchNorm's
        assert torch.equal(out["ema"], results[0]["ema"])
