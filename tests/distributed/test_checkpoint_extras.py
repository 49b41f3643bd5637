"""A script's learning-rate schedule resumes with its weights on 2 gloo workers, sharded or not:
`phalanx.checkpoint(..., extras={"schedule": ...})` after 3 of 6 steps, then everything built
afresh and `phalanx.resume(..., extras=...)`, ends bitwise where 6 uninterrupted steps end
(float64, AdamW, a warm-up over 5 steps, so the resume lands mid-warm-up). The sharded replicas
(ZeRO stages 1 and 3) keep the schedule's state in the manifest rank 0 writes; every rank loads
it. One device's version and the refusals are tests/unit/test_checkpoint_extras.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phalanx
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

BATCH, SEED, STEPS, STOP = 12, 0, 6, 3


def _build(world, shard: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
    dp = phalanx.prepare(model, world=world, dtype="float64", shard=shard)
    if shard == "none":
        optimizer = torch.optim.AdamW(dp.parameters(), lr=0.05, weight_decay=0.01)
    else:
        optimizer = dp.optimizer(torch.optim.AdamW, lr=0.05, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))
    return dp, optimizer, schedule


def _steps(world, dp, optimizer, schedule, steps: range) -> None:
    for i in steps:
        g = torch.Generator().manual_seed(i)
        X, y = torch.randn(BATCH, 4, generator=g, dtype=torch.float64), torch.randint(0, 2, (BATCH,), generator=g)
        mine = phalanx.rank_shard(torch.arange(BATCH), rank=world.rank, world_size=world.world_size)
        optimizer.zero_grad()
        loss_sum = nn.functional.cross_entropy(dp(X[mine]), y[mine], reduction="sum")
        phalanx.shard_loss(loss_sum, BATCH).backward()
        dp.finish_gradient_sync()
        optimizer.step()
        schedule.step()


def _whole(dp) -> dict[str, torch.Tensor]:
    state = dp.full_state_dict() if dp.sharding is not None else dp.state_dict()
    return {k: v.detach().clone() for k, v in state.items()}


def _worker(world, directory: str, shard: str) -> dict:
    straight = _build(world, shard)
    _steps(world, *straight, range(STEPS))
    want = _whole(straight[0])
    straight[0].close()

    stopped = _build(world, shard)
    _steps(world, *stopped, range(STOP))
    phalanx.checkpoint(directory, world=world, model=stopped[0], optimizer=stopped[1], epoch=0, step=STOP,
                       global_batch_size=BATCH, seed=SEED, extras={"schedule": stopped[2]})
    stopped[0].close()

    resumed = _build(world, shard)
    position = phalanx.resume(directory, world=world, model=resumed[0], optimizer=resumed[1], global_batch_size=BATCH,
                              seed=SEED, extras={"schedule": resumed[2]})
    lr_after_resume = resumed[1].param_groups[0]["lr"]
    _steps(world, *resumed, range(position.step, STEPS))
    got = _whole(resumed[0])
    resumed[0].close()
    return {"step": position.step, "lr": lr_after_resume, "last_epoch": resumed[2].last_epoch,
            "equal": all(torch.equal(got[k], want[k]) for k in want)}


@pytest.mark.parametrize("shard", ["none", "optimizer", "parameters"])
def test_a_resumed_schedule_ends_where_the_uninterrupted_run_ends(tmp_path, shard):
    results = run_workers(_worker, 2, str(tmp_path), shard, timeout_s=120)
    for rank, found in enumerate(results):
        assert found["step"] == STOP and found["last_epoch"] == STEPS, (rank, found)
        assert found["lr"] == pytest.approx(0.05 * (STOP + 1) / 5), (rank, found)  # mid-warm-up, not its start
        assert found["equal"], (rank, found)
