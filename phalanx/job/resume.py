"""Where a `phalanx train` run starts, and what its checkpoints must agree on to be continued.

A run continues from `--resume DIR`, from `--resume auto` (the checkpoint dir's checkpoint, if
there is one), or - when torchrun restarts a job that checkpoints - auto by itself; the restart
loop (elastic.py) names the checkpoint explicitly. A directory's newest checkpoint that is
damaged (its CRCs fail) gives way to the one before it, and the resumed line says so; a file
named on its own is refused instead, naming the one before it. What must match is the fingerprint: the
model, the settings that decide the update (global batch, seed, dtype) and the data set's
identity (name, sizes, a hash of the training set's bytes), refused in one line on a mismatch.
What may change - lr, warm-up, epochs, gradient clipping, the device count (k devices compute
the 1-device update, so any count continues the same trajectory), sharding (any stage reads any
other's checkpoint) - is recorded with the checkpoint, and the resumed run's first line names
each change. A damaged newest checkpoint the run went back past is set aside (resume's line says
where), so the run's next save cannot rotate it over the intact one it resumed from.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from phalanx.train import checkpoint as ckpt
from phalanx.job.agreement import check_same_start
from phalanx.job.config import TrainConfig
from phalanx.job.optim import check_checkpoint
from phalanx.train.sharded_checkpoint import optimizer_groups
from phalanx.runtime.world import World, launcher_env

# What a resumed run may change, and how its log line names each.
CHANGEABLE = {"lr": "--lr", "warmup_epochs": "--warmup-epochs", "epochs": "--epochs",
              "clip_grad_norm": "--clip-grad-norm", "num_devices": "devices", "shard": "--shard"}


@dataclass(frozen=True, kw_only=True)
class Start:
    """Where the run starts, and the changeable settings the checkpoint was saved with ({}: a
    fresh start, or a checkpoint that did not record them)."""

    position: ckpt.Position
    earlier: dict = field(default_factory=dict)


def dataset_identity(data) -> dict:
    """A data set's name, sizes and a SHA-256 of its training images and labels: the bytes the
    updates are computed from (hashed in place; ~0.03 s for Fashion-MNIST's 47 MB here)."""
    digest = hashlib.sha256()
    for tensor in (data.train_images, data.train_labels):
        digest.update(tensor.contiguous().numpy().data)
    return {"name": data.name, "num_train": int(data.train_images.shape[0]), "num_test": int(data.test_images.shape[0]),
            "num_classes": int(data.num_classes), "train_sha256": digest.hexdigest()}


def run_fingerprint(config: TrainConfig, model: torch.nn.Module, *, data: dict | None = None) -> dict:
    """A `phalanx train` run's fingerprint: its whole model, the settings that decide the update
    (the optimizer among them) and the data set's identity (`dataset_identity`)."""
    return ckpt.fingerprint(model, model_name=config.model, global_batch_size=config.global_batch_size,
                            seed=config.seed, dtype=config.dtype, data=data, optimizer=config.optim.optimizer)


def run_settings(config: TrainConfig, *, num_devices: int) -> dict:
    """What a resumed run may change, recorded with each checkpoint so it can say what changed."""
    return {"lr": config.optim.lr, "warmup_epochs": config.optim.warmup_epochs, "epochs": config.epochs,
            "clip_grad_norm": config.optim.clip_grad_norm, "num_devices": num_devices,
            "shard": config.data_parallel.shard if num_devices > 1 else "none"}


def requested_resume(config: TrainConfig) -> str | None:
    """What this run continues from: --resume's value, or "auto" when torchrun restarted a job
    that checkpoints (TORCHELASTIC_RESTART_COUNT > 0), else None."""
    if config.checkpoint.resume is not None:
        return config.checkpoint.resume
    env = launcher_env()
    if config.checkpoint.every is not None and env is not None and env.restart_count > 0:
        return "auto"  # torchrun restarted the job: pick up where the last checkpoint left off
    return None


def check_named_checkpoint(config: TrainConfig) -> None:
    """Before any worker starts: a checkpoint `--resume` names (a file or a directory, not auto)
    that no worker could read - missing, damaged, not loadable as weights only, not phalanx's -
    is refused now, in the one line the workers would give, not after they spawned and read the
    data (a damaged file under --devices cpu:2, synthetic data: named after 1.6 s, was 3.1). It is
    read whole (its CRCs, then `torch.load`), and read again by the run that uses it: 33 ms for
    the 46.6 MB of the 5.8 M-parameter MLP's. Whether it fits this run's model and settings needs
    the model: the workers judge that (`resume_run`)."""
    if config.checkpoint.resume not in (None, "auto"):
        ckpt.read_newest(config.checkpoint.resume)


def resume_run(config: TrainConfig, *, world: World, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               data: Callable[[], dict], log: Callable[[str], None], dp=None) -> Start:
    """Where a `phalanx train` run starts: a checkpoint's position, or epoch 0, step 0.

    The checkpoint is checked against (`data()`: this run's `dataset_identity`) and restored into
    `model`, the whole model (whichever way the run splits it), and `optimizer`, one over that
    model's parameters - or, for a sharded replica `dp`, its module and sharded optimizer. Whole
    and sharded checkpoints load either way, at any device count. One log line says where it
    resumed and what changed since.
    """
    resume = requested_resume(config)
    fresh = resume is None
    if resume == "auto":
        resume = config.checkpoint_location
        fresh = not ckpt.has_checkpoint(resume)
    read = None if fresh else ckpt.read_newest(resume)
    # Each node reads its own --out: one that cannot see the others' checkpoint would start over.
    check_same_start(world, data=data, start=None if read is None else (
        int(read[1]["epoch"]), int(read[1]["step"]), str(read[0])), looked_in=resume)
    if read is None:
        if resume is not None:
            log(f"no checkpoint in {resume} yet: starting from scratch")
        return Start(position=ckpt.Position(epoch=0, step=0))
    path, state, passed_over = read
    ckpt.check_compatible(state, run_fingerprint(config, model, data=data()), path=path)
    check_checkpoint(optimizer_groups(state), config.optim, path=path)
    position = ckpt.restore(state, world=world, model=model, optimizer=optimizer, dp=dp, path=path)
    if passed_over:  # the damaged newest file is no generation from here on
        passed_over += ckpt.set_aside_passed_over(resume, path, world=world)
    earlier = dict(state.get("settings") or {})
    now = run_settings(config, num_devices=world.world_size)
    text = lambda value: value if isinstance(value, str) else "none" if value is None else f"{value:g}"  # noqa: E731
    # A setting the checkpoint predates (clip_grad_norm before it was recorded) is not named.
    changes = [f"{CHANGEABLE[key]} {text(earlier[key])} -> {text(now[key])}" for key in CHANGEABLE
               if key in earlier and earlier[key] != now[key]]
    notes = f"; {passed_over}" if passed_over else ""  # first: the run goes back further than asked
    if changes:
        notes += f"; changed since the checkpoint: {', '.join(changes)}"
    if "data" not in state["fingerprint"]:
        notes += "; the checkpoint predates data-set fingerprints, so its data set is not checked"
    log(f"resumed from {path} at epoch {position.epoch + 1}, step {position.step}{notes}")
    return Start(position=position, earlier=earlier)


def mixed_lr(start: Start, config: TrainConfig, epoch: int) -> dict:
    """The row fields of an epoch trained at two rates (resumed mid-epoch with another --lr): the
    earlier rate and how many of its steps ran at it; {} for every other epoch."""
    earlier_lr = start.earlier.get("lr")
    if epoch != start.position.epoch or start.position.step == 0 or earlier_lr in (None, config.optim.lr):
        return {}
    return {"lr_before_resume": earlier_lr, "steps_before_resume": start.position.step}
