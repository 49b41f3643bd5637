"""The after-step callback both training jobs share: warm-up lr, finite checks, replica checks at
--check-every steps, mid-epoch checkpoints every --checkpoint-every steps (never at epoch end)."""

from __future__ import annotations

import pytest
import torch

from phalanx.data_parallel.guards.checks import NonFinite
from phalanx.job.checkpointing import CheckpointConfig
from phalanx.job.config import TrainConfig
from phalanx.job.optim import OptimizerConfig
from phalanx.job.step_hook import after_step_hook
from phalanx.runtime.world import World

WORLD = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), backend="none",
              timeout_s=10.0)


def _hook(tmp_path, *, epoch=0, warmup=0, grads=None, **config):
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=0.2)
    saved, checked = [], []
    config = TrainConfig(optim=OptimizerConfig(lr=0.2), out_dir=str(tmp_path), **config)
    hook = after_step_hook(config=config, world=WORLD, optimizer=optimizer, epoch=epoch, warmup=warmup,
                           gradients=lambda: grads or {"w": torch.zeros(2)}, save=saved.append,
                           check_replicas=checked.append)
    return hook, optimizer, saved, checked


def test_checkpoints_every_n_steps_but_not_at_epoch_end(tmp_path):
    hook, _, saved, _ = _hook(tmp_path, epoch=1, checkpoint=CheckpointConfig(every="2"))
    for done in range(1, 5):
        hook(done, 4, torch.tensor(1.0), lambda: [1.0, 2.0])
    assert [(p.epoch, p.step, p.epoch_totals) for p in saved] == [(1, 2, (1.0, 2.0))]  # step 4 ends the epoch


def test_checks_replicas_and_gradients_at_check_steps_only(tmp_path):
    hook, _, _, checked = _hook(tmp_path, epoch=1, check_every=3)
    for done in range(1, 6):
        hook(done, 5, torch.tensor(1.0), list)
    assert checked == [6, 9]  # global steps 6..10: the multiples of 3
    bad, _, _, _ = _hook(tmp_path, check_every=1, grads={"fc.weight": torch.tensor([float("nan")])})
    with pytest.raises(NonFinite, match="fc.weight"):
        bad(1, 5, torch.tensor(1.0), list)


def test_nan_loss_is_caught_every_step_on_cpu_and_warmup_sets_the_lr(tmp_path):
    hook, optimizer, _, _ = _hook(tmp_path, warmup=4, check_every=0)
    hook(1, 10, torch.tensor(1.0), list)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2 * 2 / 4)  # lr of the next step, global step 1
    with pytest.raises(NonFinite, match="loss is nan at step 2"):
        hook(2, 10, torch.tensor(float("nan")), list)
