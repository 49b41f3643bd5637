"""One worker's whole job for `--split layers|channels`: the data-parallel job's contract, model-parallel.

`train_worker` (job.py) hands a run here when the config names a model-parallel split. What a
user sees is the same: the same launcher, timeouts and pre-flight check, metrics.jsonl after
every epoch, accuracy.png, and a `model.pt` that is one ordinary LeNet state dict (the shards
gathered), so a model trained any way loads the same way. Checkpoints hold that same whole
state dict too (gathered before each save, sliced after each load), so a run resumes exactly -
and may even resume under another split, since every split computes the same update.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

import torch

from phalanx.data import load_dataset
from phalanx.models import build_model
from phalanx.parallel.guards import model_fingerprint, preflight_check
from phalanx.parallel.splits import build_split
from phalanx.telemetry import MetricsFile, ProgressBar, RankZeroLog, plot_accuracy
from phalanx.telemetry.metrics import read_metrics
from phalanx.train import checkpoint as ckpt
from phalanx.train.config import TrainConfig
from phalanx.train.job import Outputs, _resume, save_state_dict
from phalanx.train.step_hook import after_step_hook
from phalanx.train.schedule import lr_at, set_lr, warmup_steps
from phalanx.train.split_loop import evaluate_split, train_split_epoch
from phalanx.world import World


def split_worker(world: World, config: TrainConfig, device_names: Sequence[str]) -> dict[str, Any]:
    log = RankZeroLog(enabled=world.is_main)
    data = load_dataset(config.dataset, config.data_dir, log=log)
    torch.manual_seed(config.seed)  # the same whole model on every rank; each keeps its share
    full = build_model(config.model, init=config.init, num_classes=data.num_classes).to(getattr(torch, config.dtype))
    split = build_split(config.split, full, world=world, global_batch_size=config.global_batch_size,
                        micro_batches=config.micro_batches,
                        schedule=config.schedule, num_classes=data.num_classes)
    optimizer = torch.optim.SGD(split.module.parameters(), lr=config.lr)
    full_optimizer = torch.optim.SGD(full.parameters(), lr=config.lr)  # what a checkpoint's optimizer state is
    steps_per_epoch = -(-data.train_images.shape[0] // config.global_batch_size)
    preflight_check(world, {"model": model_fingerprint(full), "split": split.describe(),
                            "world_size": world.world_size, "steps_per_epoch": steps_per_epoch,
                            "global_batch_size": config.global_batch_size, "micro_batches": config.micro_batches,
                            "schedule": config.schedule, "dtype": config.dtype, "seed": config.seed})
    # job._resume checks the checkpoint against, and restores it into, the whole model.
    start = _resume(config, world=world, dp=SimpleNamespace(module=full), optimizer=full_optimizer, log=log)
    split.load_full_state_dict({k: v.to(world.device) for k, v in full.state_dict().items()})
    fp = ckpt.fingerprint(full, model_name=config.model, global_batch_size=config.global_batch_size,
                          seed=config.seed, dtype=config.dtype)

    def gather_full() -> torch.nn.Module:
        full.load_state_dict(split.full_state_dict())  # a collective: every rank calls it
        return full

    def save(position: ckpt.Position) -> None:
        set_lr(full_optimizer, optimizer.param_groups[0]["lr"])
        ckpt.save_checkpoint(config.checkpoint_location, world=world, model=gather_full(), optimizer=full_optimizer,
                             position=position, fingerprint=fp)

    devices_text = "[" + ", ".join(device_names) + "]"
    log(f"training {config.model} on {data.name} ({data.train_images.shape[0]} train / {data.test_images.shape[0]} "
        f"test images) on {devices_text}: global batch {config.global_batch_size}, lr {config.lr}, split "
        f"{config.split}: {split.describe()}; activations sent point to point, contiguous")
    images, labels = data.train_images.to(world.device), data.train_labels.to(world.device)
    test_images, test_labels = data.test_images.to(world.device), data.test_labels.to(world.device)
    outputs = Outputs(out_dir=Path(config.out_dir)) if config.out_dir else None
    metrics, history = None, []
    if outputs is not None and world.is_main:
        os.makedirs(outputs.out_dir, exist_ok=True)
        metrics = MetricsFile(outputs.metrics)
        if start.epoch > 0 and outputs.metrics.exists():
            metrics.rows = [r for r in read_metrics(outputs.metrics) if r.get("epoch", 0) <= start.epoch]
            history = [dict(r) for r in metrics.rows]
    warmup = warmup_steps(config.warmup_epochs, steps_per_epoch)
    for epoch in range(start.epoch, config.epochs):
        first_step = start.step if epoch == start.epoch else 0
        set_lr(optimizer, lr_at(epoch * steps_per_epoch + first_step, base_lr=config.lr, warmup=warmup))
        bar = ProgressBar(label=f"epoch {epoch + 1}/{config.epochs}", enabled=world.is_main and config.progress)

        after_step = after_step_hook(
            config=config, world=world, optimizer=optimizer, epoch=epoch, warmup=warmup, save=save,
            gradients=lambda: {n: p.grad for n, p in split.module.named_parameters() if p.grad is not None})

        stats = train_split_epoch(split, optimizer, images, labels, world=world,
                                  global_batch_size=config.global_batch_size, seed=config.seed, epoch=epoch,
                                  start_step=first_step, start_totals=start.epoch_totals if epoch == start.epoch else (),
                                  after_step=after_step, on_step=bar.update)
        bar.close()
        test_acc = evaluate_split(split, test_images, test_labels, world=world, batch_size=config.eval_batch_size)
        row = {"epoch": epoch + 1, "train_loss": stats.train_loss, "train_acc": stats.train_acc, "test_acc": test_acc,
               "epoch_s": stats.elapsed_s, "images_per_s": stats.num_examples / stats.elapsed_s,
               "devices": list(device_names), "global_batch_size": config.global_batch_size, "lr": config.lr,
               "warmup_epochs": config.warmup_epochs, "dtype": config.dtype, "split": config.split,
               "micro_batches": getattr(split, "micro_batches", None), "schedule": config.schedule
               if config.split == "layers" else None}
        history.append(row)
        log(f"epoch {epoch + 1:3d}  loss {stats.train_loss:.4f}  train acc {stats.train_acc:.3f}  "
            f"test acc {test_acc:.3f}  {stats.elapsed_s:.2f} s  {row['images_per_s']:.0f} img/s")
        if metrics is not None:
            metrics.append(row)
        if config.checkpoint_every is not None:
            save(ckpt.Position(epoch=epoch + 1, step=0))
    if not history:
        log(f"nothing to train: the checkpoint is at the end of epoch {start.epoch}")
        return {"history": [], "sec_per_epoch": 0.0, "dataset": data.name}
    gather_full()
    sec_per_epoch = sum(r["epoch_s"] for r in history) / len(history)
    if outputs is not None and world.is_main:
        plot_accuracy(outputs.accuracy_png, epochs=[r["epoch"] for r in history],
                      test_acc=[r["test_acc"] for r in history], train_acc=[r["train_acc"] for r in history],
                      title=f"{config.model} on {data.name}, {devices_text}, split {config.split}")
        save_state_dict(outputs.model, full)
    log(f"test acc: {history[-1]['test_acc']:.2f}, {sec_per_epoch:.1f} sec/epoch on {devices_text}")
    return {"history": history, "sec_per_epoch": sec_per_epoch, "dataset": data.name}
