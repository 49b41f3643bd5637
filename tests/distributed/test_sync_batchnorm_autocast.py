"""Synchronized BatchNorm under bf16 autocast on 2 gloo processes equals 1-device BatchNorm
under the same autocast on the full batch, within bf16's tolerance.

A conv + BatchNorm2d and a linear + BatchNorm1d model, each with `prepare(precision="bf16-mixed")`
and with a plain `torch.autocast("cpu", dtype=torch.bfloat16)` around the replica's forward: two
training steps (forward, backward, gradient exchange, SGD step), whose outputs, and then every
parameter and running statistic, are compared with torch's own BatchNorm stepping on the whole
batch in one process. Rank 1's half of each batch is shifted, so per-device statistics (policy
`local`) would miss the outputs by far more than bf16's tolerance. The half/bf16 input beside float32 parameters is torch's mixed-precision BatchNorm;
tests/unit/test_models_bn.py checks the layer alone (and on CUDA, fp16 and bf16).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.data_parallel import SyncBatchNorm
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

MODELS = ("conv", "bn1d")
WAYS = ("bf16-mixed", "autocast")
GLOBAL_BATCH_SIZE, STEPS = 16, 2


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "conv":
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2))
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))


def _batch(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    shape = (GLOBAL_BATCH_SIZE, 3, 6, 6) if kind == "conv" else (GLOBAL_BATCH_SIZE, 3)
    x = torch.randn(shape, generator=gen) * 2 + 1
    x[GLOBAL_BATCH_SIZE // 2 :] += 3  # rank 1's half: its own statistics are far from the batch's
    return x, torch.randint(0, 2, (GLOBAL_BATCH_SIZE,), generator=gen)


def _worker(world) -> dict:
    results = {}
    for kind in MODELS:
        for way in WAYS:
            dp = phalanx.prepare(_model(kind), world=world, memory_format="contiguous",
                                 precision="bf16-mixed" if way == "bf16-mixed" else None)
            assert any(isinstance(m, SyncBatchNorm) for m in dp.modules()), "no sync BatchNorm to test"
            optimizer = torch.optim.SGD(dp.parameters(), lr=0.1)
            outputs = []
            for step in range(STEPS):
                x, y = _batch(kind, step)
                mine = phalanx.rank_shard(torch.arange(GLOBAL_BATCH_SIZE), rank=world.rank,
                                          world_size=world.world_size)
                optimizer.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=way == "autocast"):
                    out = dp(x[mine])
                outputs.append(out.detach().float())
                loss = F.cross_entropy(out.float(), y[mine], reduction="sum")
                phalanx.shard_loss(loss, GLOBAL_BATCH_SIZE).backward()
                dp.finish_gradient_sync()
                optimizer.step()
            results[kind, way] = outputs, {k: v.clone() for k, v in dp.module.state_dict().items()}
            dp.close()
    return results


def _reference(kind: str) -> dict:
    model = _model(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    outputs = []
    for step in range(STEPS):
        x, y = _batch(kind, step)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        outputs.append(out.detach().float())
        (F.cross_entropy(out.float(), y, reduction="sum") / GLOBAL_BATCH_SIZE).backward()
        optimizer.step()
    return outputs, model.state_dict()


@pytest.fixture(scope="module")
def ranks():
    return run_workers(_worker, 2, timeout_s=180)


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("kind", MODELS)
def test_bf16_autocast_sync_batchnorm_trains_as_one_device_does(ranks, kind, way):
    want_outputs, want = _reference(kind)
    # bf16's tolerance (8 bits of mantissa): the shards' bf16 roundings differ from the full batch's.
    bf16 = dict(rtol=1.6e-2, atol=1e-2)
    for rank, results in enumerate(ranks):
        outputs, got = results[kind, way]
        rows = slice(rank * GLOBAL_BATCH_SIZE // 2, (rank + 1) * GLOBAL_BATCH_SIZE // 2)
        for step, (out, want_out) in enumerate(zip(outputs, want_outputs)):
            torch.testing.assert_close(out, want_out[rows], **bf16, msg=lambda m, s=step: f"rank {rank} step {s}: {m}")
        assert got.keys() == want.keys()
        for key, value in want.items():
            tol = bf16 if value.is_floating_point() else dict(rtol=0, atol=0)
            torch.testing.assert_close(got[key], value, **tol, msg=lambda m, key=key: f"rank {rank} {key}: {m}")
    torch.testing.assert_close(ranks[0][kind, way][1], ranks[1][kind, way][1], rtol=0, atol=0)  # one model
