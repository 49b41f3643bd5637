"""What a training job does after each optimizer step, whichever way the work is split.

`after_step_hook` builds the callback that train_epoch calls after every step, whichever
strategy runs it (data, layers, channels): note the step for failure reports, follow the
warm-up lr schedule, check the loss for NaN/Inf (and, at `--check-every` steps and each epoch's
last, a model split's gradients and the replicas), save a mid-epoch checkpoint every
`--checkpoint-every` steps, and stop, saved, after the step the ranks agree on when a scheduler
asked (train/stopping.py).
One place, so the data split and the layer/channel splits cannot drift apart in what they guard.
The data split's gradient is not read here: its replica checks it at the same interval
(data_parallel/guards/finite.py, which can tell the rank whose share went NaN/Inf first), and the
job has it check the steps since then at each epoch's end and before each checkpoint.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from phalanx.runtime.launch import report_progress
from phalanx.data_parallel.guards.checks import check_finite
from phalanx.train import checkpoint as ckpt
from phalanx.job.config import TrainConfig
from phalanx.job.schedule import lr_at, set_lr
from phalanx.train.stopping import StopCheck
from phalanx.runtime.world import World


def after_step_hook(*, config: TrainConfig, world: World, optimizer: torch.optim.Optimizer, epoch: int,
                    warmup: int, gradients: Callable[[], Mapping[str, torch.Tensor]],
                    save: Callable[[ckpt.Position], None],
                    check_replicas: Callable[[int], None] | None = None,
                    stop: StopCheck | None = None, survivors=None) -> Callable[..., None]:
    """The callback for `epoch`. `gradients()` names this rank's gradients (read only at check
    steps and the epoch's last); `check_replicas(step)`, when given, compares the replicas at check
    steps; `stop`, when given, ends the run (raises Stopped) after saving the step it agrees on;
    `survivors` (survivors.py's SurvivorsSave), when given, is told each step and its sums."""

    def after_step(done: int, total: int, loss_sum: torch.Tensor, totals: Callable[[], list[float]]) -> None:
        global_step = epoch * total + done
        report_progress(global_step)
        if survivors is not None:  # before any collective of this hook: a peer lost in one finds it posted
            survivors.post(epoch, done, totals())
        if warmup:
            set_lr(optimizer, lr_at(global_step, base_lr=config.optim.lr, warmup=warmup))
        checking = bool(config.check_every) and global_step % config.check_every == 0
        # A model split's gradients at --check-every steps and at the epoch's last (before its row).
        reading = checking or (bool(config.check_every) and done == total)
        # The loss every step on CPU (free); on a GPU only when the gradients are read, as reading it syncs.
        check_finite(loss=loss_sum if reading or world.device.type == "cpu" else None,
                     buffers=gradients() if reading else {}, step=global_step, rank=world.rank)
        if checking and check_replicas is not None:
            check_replicas(global_step)
        every = config.checkpoint.steps
        saving = bool(every) and global_step % every == 0 and done < total  # an epoch's end: by the job
        stopping = stop is not None and stop.agreed(global_step)
        if saving or stopping:  # a stop after an epoch's last step saves it too (a resume evaluates it)
            save(ckpt.Position(epoch=epoch, step=done, epoch_totals=tuple(totals())))
        if stopping:
            raise stop.stopped(f"epoch {epoch + 1}, step {done} of {total}")

    return after_step
