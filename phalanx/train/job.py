"""One worker's whole training job: data, replica, epochs, evaluation, outputs (rank 0 writes).

`train_worker` runs identically in every process - spawned by `phalanx.launch`, started by
torchrun, or alone for one device. Rank 0 reports and writes `--out`: metrics.jsonl after every
epoch, accuracy.png, and model.pt (the final `state_dict`, loadable with weights_only=True).
All writes are atomic, and they happen before teardown so an exit-time abort cannot lose them.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from phalanx.atomic import atomic_write_bytes
from phalanx.binding import describe as describe_cores
from phalanx.data import load_dataset
from phalanx.models import build_model
from phalanx.parallel import (GRAD_DTYPES, DataParallel, apply_memory_format, average_running_stats, convert_sync_batchnorm,
                              format_name, resolve_memory_format)
from phalanx.telemetry import MetricsFile, ProgressBar, RankZeroLog, Tracer, format_summary, plot_accuracy, span
from phalanx.telemetry.metrics import read_metrics
from phalanx.parallel.guards import check_replicas, model_fingerprint, preflight_check
from phalanx.train import checkpoint as ckpt
from phalanx.train.config import TrainConfig
from phalanx.train.evaluate import evaluate
from phalanx.train.loop import train_epoch
from phalanx.train.schedule import lr_at, set_lr, warmup_steps
from phalanx.train.step_hook import after_step_hook
from phalanx.world import World, launcher_env


@dataclass(frozen=True, kw_only=True)
class Outputs:
    """Paths under --out; created by rank 0 only once training actually starts."""

    out_dir: Path

    @property
    def metrics(self) -> Path:
        return self.out_dir / "metrics.jsonl"

    @property
    def accuracy_png(self) -> Path:
        return self.out_dir / "accuracy.png"

    @property
    def model(self) -> Path:
        return self.out_dir / "model.pt"


def save_state_dict(path: Path, module: torch.nn.Module) -> None:
    buffer = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in module.state_dict().items()}, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def train_worker(world: World, config: TrainConfig, device_names: Sequence[str]) -> dict[str, Any]:
    if config.split != "data":  # the model-parallel splits (issue 13); imported here: it imports this module
        from phalanx.train.split_job import split_worker

        return split_worker(world, config, device_names)
    log = RankZeroLog(enabled=world.is_main)
    data = load_dataset(config.dataset, config.data_dir, log=log)

    torch.manual_seed(config.seed)  # same init everywhere; the broadcast makes it a guarantee
    model = build_model(config.model, init=config.init, num_classes=data.num_classes)
    model = model.to(getattr(torch, config.dtype))
    # A no-op for models without BatchNorm; on one device plain BatchNorm already sees the whole
    # batch (and SyncBatchNorm would read its count on the host every step).
    if config.batchnorm == "sync" and world.distributed:
        model = convert_sync_batchnorm(model, world)
    memory_format = resolve_memory_format(config.memory_format, model, world.device)
    model = apply_memory_format(model, memory_format)
    # Without overlap one flat bucket is fastest: every gloo call pays a ~1 ms floor.
    dp = DataParallel(
        model,
        world=world,
        algorithm=config.allreduce,
        overlap=config.overlap,
        bucket_cap_mb=config.bucket_cap_mb if config.overlap else None,
        grad_dtype=None if config.grad_dtype is None else GRAD_DTYPES[config.grad_dtype],
    )
    if config.trace_dir is not None:
        dp.tracer = Tracer(rank=world.rank, world_size=world.world_size, steps_per_epoch=config.trace_steps)
    try:
        optimizer = torch.optim.SGD(dp.module.parameters(), lr=config.lr)
        steps_per_epoch = -(-data.train_images.shape[0] // config.global_batch_size)
        preflight_check(world, {"model": model_fingerprint(dp.module), "buckets": [b.size_bytes for b in dp.buckets],
                                "world_size": world.world_size, "steps_per_epoch": steps_per_epoch,
                                "global_batch_size": config.global_batch_size, "allreduce": config.allreduce,
                                "overlap": config.overlap, "grad_dtype": config.grad_dtype, "dtype": config.dtype, "seed": config.seed})
        start = _resume(config, world=world, dp=dp, optimizer=optimizer, log=log)
        result = _run_epochs(dp, optimizer, world=world, config=config, data=data, log=log,
                             device_names=device_names, memory_format=format_name(memory_format), start=start)
        if dp.tracer is not None:
            dp.tracer.write(config.trace_dir)
            if world.is_main:
                log(format_summary(dp.tracer.summary()))
                log(f"traces in {config.trace_dir}/trace-rank*.json (open in https://ui.perfetto.dev)")
        return result
    finally:
        dp.close()  # stops AsyncComm's thread and group before the launcher's stop_world


def _run_epochs(
    dp: DataParallel, optimizer: torch.optim.Optimizer, *, world: World, config: TrainConfig, data, log: RankZeroLog,
    device_names: Sequence[str], memory_format: str, start: ckpt.Position,
) -> dict[str, Any]:
    """Train for config.epochs, evaluate after each, and (rank 0) write the outputs."""
    devices_text = "[" + ", ".join(device_names) + "]"
    train_images = data.train_images.to(world.device)
    train_labels = data.train_labels.to(world.device)
    test_images = data.test_images.to(world.device)
    test_labels = data.test_labels.to(world.device)
    outputs = Outputs(out_dir=Path(config.out_dir)) if config.out_dir else None
    metrics = None
    history: list[dict[str, Any]] = []
    if outputs is not None and world.is_main:
        os.makedirs(outputs.out_dir, exist_ok=True)
        metrics = MetricsFile(outputs.metrics)
        if start.epoch > 0 and outputs.metrics.exists():  # keep the finished epochs' rows only
            metrics.rows = [r for r in read_metrics(outputs.metrics) if r.get("epoch", 0) <= start.epoch]
            history = [dict(r) for r in metrics.rows]
    fp = ckpt.fingerprint(dp.module, model_name=config.model, global_batch_size=config.global_batch_size,
                          seed=config.seed, dtype=config.dtype)

    def save(position: ckpt.Position) -> None:
        ckpt.save_checkpoint(config.checkpoint_location, world=world, model=dp.module, optimizer=optimizer,
                             position=position, fingerprint=fp)
    log(
        f"training {config.model} on {data.name} ({data.train_images.shape[0]} train / "
        f"{data.test_images.shape[0]} test images) on {devices_text}: global batch "
        f"{config.global_batch_size}, lr {config.lr}, allreduce {_algorithm_text(config, dp)}, "
        f"{_exchange_text(config, dp)}, {memory_format}{_placement_text(config, world)}"
    )

    steps_per_epoch = -(-data.train_images.shape[0] // config.global_batch_size)
    warmup = warmup_steps(config.warmup_epochs, steps_per_epoch)
    for epoch in range(start.epoch, config.epochs):
        first_step = start.step if epoch == start.epoch else 0
        set_lr(optimizer, lr_at(epoch * steps_per_epoch + first_step, base_lr=config.lr, warmup=warmup))
        bar = ProgressBar(label=f"epoch {epoch + 1}/{config.epochs}", enabled=world.is_main and config.progress)

        after_step = after_step_hook(config=config, world=world, optimizer=optimizer, epoch=epoch, warmup=warmup,
                                     gradients=dp.named_gradients, save=save,
                                     check_replicas=lambda step: check_replicas(world, dp.module, step=step))

        stats = train_epoch(
            dp,
            optimizer,
            train_images,
            train_labels,
            world=world,
            global_batch_size=config.global_batch_size,
            seed=config.seed,
            epoch=epoch,
            grad_accum_steps=config.grad_accum_steps,
            on_step=bar.update,
            tracer=dp.tracer,
            start_step=first_step,
            start_totals=start.epoch_totals if epoch == start.epoch else (),
            after_step=after_step,
        )
        bar.close()
        if config.batchnorm == "local":  # per-device statistics: replicas' running stats drift apart
            average_running_stats(dp.module, world=world)
        with span(dp.tracer, "evaluate"):
            test_acc = evaluate(dp.module, test_images, test_labels, world=world, batch_size=config.eval_batch_size)
        row = {
            "epoch": epoch + 1,
            "train_loss": stats.train_loss,
            "train_acc": stats.train_acc,
            "test_acc": test_acc,
            "epoch_s": stats.elapsed_s,
            "images_per_s": stats.num_examples / stats.elapsed_s,
            "devices": list(device_names),
            "global_batch_size": config.global_batch_size,
            "lr": config.lr,
            "warmup_epochs": config.warmup_epochs,
            "allreduce": dp.algorithm,
            "dtype": config.dtype,
            "overlap": config.overlap,
            "grad_dtype": config.grad_dtype,
            "num_buckets": len(dp.buckets),
            "grad_accum_steps": config.grad_accum_steps,
            "memory_format": memory_format,
            "batchnorm": config.batchnorm,
        }
        history.append(row)
        log(
            f"epoch {epoch + 1:3d}  loss {stats.train_loss:.4f}  train acc {stats.train_acc:.3f}  "
            f"test acc {test_acc:.3f}  {stats.elapsed_s:.2f} s  {row['images_per_s']:.0f} img/s"
        )
        if metrics is not None:
            metrics.append(row)
        if config.checkpoint_every is not None:
            save(ckpt.Position(epoch=epoch + 1, step=0))

    if not history:  # resumed from a checkpoint taken after the last epoch: nothing left to do
        log(f"nothing to train: the checkpoint is at the end of epoch {start.epoch}")
        return {"history": [], "sec_per_epoch": 0.0, "dataset": data.name}
    sec_per_epoch = sum(r["epoch_s"] for r in history) / len(history)
    if outputs is not None and world.is_main:
        plot_accuracy(
            outputs.accuracy_png,
            epochs=[r["epoch"] for r in history],
            test_acc=[r["test_acc"] for r in history],
            train_acc=[r["train_acc"] for r in history],
            title=f"{config.model} on {data.name}, {devices_text}",
        )
        save_state_dict(outputs.model, dp.module)
    log(f"test acc: {history[-1]['test_acc']:.2f}, {sec_per_epoch:.1f} sec/epoch on {devices_text}")
    return {"history": history, "sec_per_epoch": sec_per_epoch, "dataset": data.name}


def _resume(config: TrainConfig, *, world: World, dp: DataParallel, optimizer, log: RankZeroLog) -> ckpt.Position:
    """Where this run starts: a checkpoint's position (--resume, or a torchrun restart), or 0/0."""
    resume = config.resume
    env = launcher_env()
    if resume is None and config.checkpoint_every is not None and env is not None and env.restart_count > 0:
        resume = "auto"  # torchrun restarted the job: pick up where the last checkpoint left off
    if resume == "auto":
        resume = config.checkpoint_location
        if not ckpt.checkpoint_path(resume).is_file():
            log(f"no checkpoint in {resume} yet: starting from scratch")
            return ckpt.Position(epoch=0, step=0)
    if resume is None:
        return ckpt.Position(epoch=0, step=0)
    state = ckpt.read_checkpoint(resume)
    expected = ckpt.fingerprint(dp.module, model_name=config.model, global_batch_size=config.global_batch_size,
                                seed=config.seed, dtype=config.dtype)
    ckpt.check_compatible(state, expected, path=ckpt.checkpoint_path(resume))
    position = ckpt.restore(state, world=world, model=dp.module, optimizer=optimizer)
    log(f"resumed from {ckpt.checkpoint_path(resume)} at epoch {position.epoch + 1}, step {position.step}")
    return position


def _algorithm_text(config: TrainConfig, dp: DataParallel) -> str:
    """The allreduce that runs, and why when auto chose it (the first log line names the transport)."""
    if config.allreduce != "auto":
        return dp.algorithm
    if dp.world.distributed and dp.algorithm == "shm":
        return "shm (auto: CPU workers on one host share memory)"
    if dp.fallback_reason is not None:
        return f"native (auto: {dp.fallback_reason.split('; use')[0]})"
    return f"{dp.algorithm} (auto)"


def _placement_text(config: TrainConfig, world: World) -> str:
    """CPU threads per worker, and the cores rank 0 was pinned to under --bind-cores."""
    if world.device.type != "cpu":
        return ""
    threads = torch.get_num_threads()
    text = f", {threads} thread{'s' if threads > 1 else ''} per worker"
    if config.bind_cores and hasattr(os, "sched_getaffinity"):
        text += f", each bound to its own cores (rank 0: {describe_cores(sorted(os.sched_getaffinity(0)))})"
    return text


def _exchange_text(config: TrainConfig, dp: DataParallel) -> str:
    sizes = ", ".join(f"{b.size_bytes / 1024:.1f}" for b in dp.buckets)
    mode = "overlapped" if config.overlap else "synchronous"
    accum = f", {config.grad_accum_steps} micro-batches per step" if config.grad_accum_steps > 1 else ""
    wire = f" sent as {config.grad_dtype}" if config.grad_dtype else ""
    warm = f", lr warmup over {config.warmup_epochs:g} epochs" if config.warmup_epochs else ""
    if not dp.exchanging:  # one device: the plain loop, no buckets, hooks or thread
        return f"no gradient exchange (one device){accum}{warm}"
    return f"{mode} gradient exchange in {len(dp.buckets)} bucket(s) of [{sizes}] KB{wire}{accum}{warm}"
