"""Sharding on CUDA (skip-guarded; written on a machine without a GPU, so first run on the GPU box).

Two ranks share cuda:0 and talk over gloo (PHALANX_RANKS_SHARE_GPU, as test_two_ranks_one_gpu.py):
every stage's reduce-scatters and all-gathers, storage freed and refilled on the device (stage 3),
the optimizer on the shard, clipping and evaluation run with CUDA tensors, and must equal one
device's plain training in float64 (1e-9 relative: cuDNN and cuBLAS may sum a shard in another
order than the whole batch).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from phalanx.data import rank_shard
from phalanx.data_parallel import prepare
from phalanx.data_parallel.clip import clip_grad_norm_
from phalanx.data_parallel.step import shard_loss
from phalanx.models import LeNet
from phalanx.runtime.devices import DevicePlan
from phalanx.runtime.launch import LaunchSpec, launch
from phalanx.runtime.world import RANKS_SHARE_GPU_VAR, World
from phalanx.train.evaluate import evaluate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BATCH_SIZES = (37, 21)
STAGES = ("none", "optimizer", "gradients", "parameters")


def _data(device: torch.device):
    gen = torch.Generator().manual_seed(7)
    X = torch.rand(sum(BATCH_SIZES), 1, 28, 28, generator=gen, dtype=torch.float64)
    return X.to(device), torch.randint(0, 10, (sum(BATCH_SIZES),), generator=gen).to(device)


def _train(world: World, stage: str) -> tuple[dict, float]:
    torch.manual_seed(0)
    dp = prepare(LeNet(), world=world, dtype="float64", memory_format="contiguous", shard=stage)
    optimizer = dp.optimizer(torch.optim.Adam, lr=1e-3)
    X, y = _data(world.device)
    start = 0
    for size in BATCH_SIZES:
        rows = rank_shard(torch.arange(start, start + size, device=world.device), rank=world.rank,
                          world_size=world.world_size)
        optimizer.zero_grad()
        shard_loss(F.cross_entropy(dp(X[rows]), y[rows], reduction="sum"), size).backward()
        dp.finish_gradient_sync()
        clip_grad_norm_(dp, 0.5)
        optimizer.step()
        start += size
    accuracy = evaluate(dp.module, (X * 255).to(torch.uint8), y, world=world, batch_size=16)
    state = {k: v.cpu() for k, v in dp.full_state_dict().items()}
    dp.close()
    return state, accuracy


def _worker(world: World) -> dict:
    return {stage: _train(world, stage) for stage in STAGES}


def test_every_stage_on_cuda_equals_one_device(monkeypatch):
    monkeypatch.setenv(RANKS_SHARE_GPU_VAR, "1")
    spec = lambda names: LaunchSpec(plan=DevicePlan(names=names), timeout_s=60.0, deadline_s=300.0)  # noqa: E731
    one = launch(_worker, spec=spec(("cuda:0",)))[0]["none"]
    two = launch(_worker, spec=spec(("cuda:0", "cuda:0")))
    for stage in STAGES:
        for rank in range(2):
            state, accuracy = two[rank][stage]
            for key, want in one[0].items():
                torch.testing.assert_close(state[key], want, rtol=1e-9, atol=1e-12, msg=f"{stage} {key}")
            assert accuracy == one[1]
