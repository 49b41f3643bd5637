"""One worker's whole training job: data, this rank's part of the model, epochs, evaluation, outputs.

`train_worker` runs identically in every process - spawned by `phalanx.runtime.launch`, started by
torchrun, or alone for one device - and for every way of splitting the work (`--split`): data
parallelism (a replica from `phalanx.prepare`) and the model splits (pipeline, channels) are
driven alike through the loop's `Strategy` interface. Rank 0 reports and writes `--out`
(outputs.py): metrics.jsonl after every epoch, accuracy.png, and model.pt - the whole model's
state dict (a split's shards gathered), so a model trained any way loads the same way.
Checkpoints hold that same whole model, so a run resumes exactly, even under another split or
device count (resume.py decides where a run starts and what must match).
"""

from __future__ import annotations

import datetime
import functools
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import torch

from phalanx.runtime.binding import describe as describe_cores, threads_note
from phalanx.data import steps_per_epoch
from phalanx.errors import UsageError
from phalanx.models import build_model, has_batchnorm
from phalanx.data_parallel.guards.checks import model_fingerprint, preflight_check
from phalanx.data_parallel.prepare import prepare_replica
from phalanx.model_split.splits import build_split
from phalanx.telemetry import ProgressBar, RankZeroLog, Tracer, format_summary, span, survive_lost_output
from phalanx.train import checkpoint as ckpt
from phalanx.job.agreement import check_same_run
from phalanx.job.config import TrainConfig
from phalanx.job.optim import build_optimizer, describe as describe_optimizer
from phalanx.train.streamed_save import stream_model
from phalanx.train.evaluate import count_accuracy
from phalanx.data_parallel.strategy import DataSplit
from phalanx.train.graphs import CudaGraph
from phalanx.train.loop import Strategy, captured_train_step, train_epoch
from phalanx.job.outputs import Outputs
from phalanx.job.resume import dataset_identity, mixed_lr, resume_run, run_fingerprint, run_settings
from phalanx.job.schedule import lr_at, set_lr, warmup_steps
from phalanx.job.step_hook import after_step_hook
from phalanx.job.survivors import arm as arm_survivors, reason_not_armed, saving as survivors_saving
from phalanx.train.stopping import stop_check
from phalanx.runtime import stop_request
from phalanx.runtime.world import World


def train_worker(world: World, config: TrainConfig, device_names: Sequence[str]) -> dict[str, Any]:
    survive_lost_output()  # `phalanx train | head`: the lines end, the training does not
    check_same_run(world, config)  # torchrun's nodes each parse their own flags: one line if they differ
    log = RankZeroLog(enabled=world.is_main)
    data = config.data.load(log=log)
    num_train = data.train_images.shape[0]
    if config.global_batch_size > num_train:  # accepted (one step per epoch), but rarely what was meant
        log(f"note: --batch-size {config.global_batch_size} is larger than the {num_train} training images, "
            f"so every step trains on all of them (one step per epoch); use --batch-size {num_train} or less")
    torch.manual_seed(config.seed)  # the same whole model on every rank; the broadcast makes it a guarantee
    model = build_model(config.model, init=config.init, num_classes=data.num_classes)
    try:
        config.check_batch_statistics(num_train, world.world_size, batchnorm=has_batchnorm(model))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    tracer = None if config.trace_dir is None else Tracer(rank=world.rank, world_size=world.world_size,
                                                          steps_per_epoch=config.trace_steps)
    strategy = build_strategy(config, model, world=world, num_classes=data.num_classes, tracer=tracer)
    # Armed where a stop can be saved: the first SIGTERM (or Ctrl-C) then ends the run after a step, saved
    # there. Through close() too, whose replica check is a collective: a stop that comes after the last step
    # lets every rank finish, where it killed the ranks that had left the armed part while a peer waited.
    with stop_request.armed(enabled=config.checkpoint_location is not None, signals=(signal.SIGTERM, signal.SIGINT)):
        try:
            with survivors_saving():  # a peer's death: the survivors save the step the run reached (survivors.py)
                result = _run(strategy, world=world, config=config, data=data, log=log, device_names=device_names,
                              tracer=tracer)
        finally:
            strategy.close()  # stops a replica's communication thread before the launcher's stop_world
    if tracer is not None:
        tracer.write(config.trace_dir)
        if world.is_main:
            log(format_summary(tracer.summary()))
            log(f"traces in {config.trace_dir}/trace-rank*.json (open in https://ui.perfetto.dev)")
    return result


def run_facts(config: TrainConfig, *, dataset: str) -> dict[str, Any]:
    """What else a metrics row says of its run, for an operator reading the file alone: what
    trained, with which seed and threads, when the row was written (UTC) and by which versions."""
    from phalanx import __version__

    return {"model": config.model, "dataset": dataset, "optimizer": config.optim.optimizer,
            "seed": config.seed, "threads_per_worker": torch.get_num_threads(),
            "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "phalanx": __version__, "torch": torch.__version__}


def build_strategy(config: TrainConfig, model: torch.nn.Module, *, world: World, num_classes: int,
                   tracer: Tracer | None = None) -> Strategy:
    """This rank's part of `model`: a prepared replica (`--split data`, its exchange traced to
    `tracer`), or its share of a model split."""
    split, options = config.split, config.data_parallel
    if split.kind != "data":
        return build_split(split.kind, model.to(getattr(torch, config.dtype)), world=world,
                           global_batch_size=config.global_batch_size, micro_batches=split.micro_batches,
                           schedule=split.schedule, num_classes=num_classes)
    # --check-every sets the gradient's NaN/Inf check too: the replica's own.
    dp = prepare_replica(model, replace(options, check_finite_every=config.check_every), world=world,
                         dtype=config.dtype, tracer=tracer)
    return DataSplit(dp, grad_accum_steps=options.grad_accum_steps, max_grad_norm=config.optim.clip_grad_norm)


def _run(strategy: Strategy, *, world: World, config: TrainConfig, data, log: RankZeroLog,
         device_names: Sequence[str], tracer: Tracer | None) -> dict[str, Any]:
    """Check the ranks agree, resume, train config.epochs (evaluating after each), write the outputs."""
    optimizer = build_optimizer(strategy, config.optim)
    replica = getattr(strategy, "dp", None)  # a data-parallel replica: sharded ones save and load shares
    steps = steps_per_epoch(data.train_images.shape[0], config.global_batch_size)
    whole = strategy.whole_model()
    preflight_check(world, {"model": model_fingerprint(whole), "strategy": strategy.describe(), **strategy.facts(),
                            "world_size": world.world_size, "steps_per_epoch": steps,
                            "global_batch_size": config.global_batch_size, "dtype": config.dtype, "seed": config.seed})
    whole_optimizer = _whole_optimizer(optimizer, strategy, whole)
    identity = functools.cache(lambda: dataset_identity(data))  # hashed by runs across nodes, or that resume or save
    begin = resume_run(config, world=world, model=whole, optimizer=whole_optimizer, data=identity, log=log, dp=replica)
    start = begin.position
    if whole is not strategy.module:  # a split: its shards take their values from the whole model
        strategy.load_full_state_dict(whole.state_dict())
    settings = run_settings(config, num_devices=world.world_size)
    stop = stop_check(world, saved_in=config.checkpoint_location, check_every=config.check_every, replica=replica)
    graph_plan = config.graph_plan(world.device.type, world.world_size, backend=world.backend)
    _set_capturable(optimizer, graph_plan.capture)

    def write_alone(position: ckpt.Position, every: list[dict], note: dict):  # one survivor of a dead peer
        return ckpt.save_alone(config.checkpoint_location, model=strategy.module, optimizer=optimizer,
                               position=position, fingerprint=run_fingerprint(config, strategy.module, data=identity()),
                               settings=settings, every=every, note=note)

    batchnorm = has_batchnorm(whole)
    why_not = reason_not_armed(world, data_split=replica is not None, batchnorm=config.data_parallel.batchnorm
                               if batchnorm else None, sharded=replica is not None and replica.sharding is not None,
                               location=config.checkpoint_location)
    survivors = arm_survivors(world, steps_per_epoch=steps, location=config.checkpoint_location, write=write_alone,
                              module=strategy.module, batchnorm=batchnorm, why_not=why_not)

    def save(position: ckpt.Position) -> None:  # every rank calls it (a split gathers its shards)
        if replica is not None:  # nothing non-finite is saved: the steps since the last check, checked
            replica.check_finite(where="the checkpoint")
        whole = strategy.whole_model()
        ckpt.save_checkpoint(config.checkpoint_location, world=world, model=whole,
                             optimizer=_whole_optimizer(optimizer, strategy, whole), position=position,
                             fingerprint=run_fingerprint(config, whole, data=identity()), settings=settings, dp=replica)

    complete = (start.epoch, start.step) == (config.epochs, 0)  # the run that saved it trained to the end
    if start.epoch >= config.epochs and not complete:  # past the last epoch: nothing to do, nothing to write
        log(f"nothing to train: the checkpoint is at {_position_text(start, steps)}, and --epochs is "
            f"{config.epochs}; pass --epochs {start.epoch + 1} or more to go on")
        return {"history": [], "sec_per_epoch": 0.0, "dataset": data.name}
    devices_text = "[" + ", ".join(device_names) + "]"
    log(f"training {config.model} on {data.name} ({data.train_images.shape[0]} train / "
        f"{data.test_images.shape[0]} test images) on {devices_text}: global batch {config.global_batch_size}, "
        f"{describe_optimizer(config.optim)}, {strategy.describe()}{graph_plan.describe()}{_schedule_text(config)}"
        f"{_placement_text(config, world)}")
    train_images, train_labels = data.train_images.to(world.device), data.train_labels.to(world.device)
    graph = captured_train_step(strategy, optimizer, train_images, train_labels,
                                global_batch_size=config.global_batch_size, backend=CudaGraph(world.device),
                                say=log) if graph_plan.capture else None
    test_images, test_labels = data.test_images.to(world.device), data.test_labels.to(world.device)
    outputs = Outputs(out_dir=Path(config.out_dir)) if config.out_dir and world.is_main else None
    metrics, history = (outputs.open_metrics(start_epoch=start.epoch, warn=RankZeroLog(enabled=True, stream=sys.stderr))
                        if outputs is not None else (None, []))
    warmup = warmup_steps(config.optim.warmup_epochs, steps)
    if complete:  # stopped after its last checkpoint (in evaluation, or writing model.pt): finish it
        log(f"training was complete at the checkpoint (the end of epoch {start.epoch}): evaluating and writing "
            f"the outputs; pass --epochs {start.epoch + 1} or more to train on")
    for epoch in range(start.epoch, config.epochs):
        first_step = start.step if epoch == start.epoch else 0
        set_lr(optimizer, lr_at(epoch * steps + first_step, base_lr=config.optim.lr, warmup=warmup))
        bar = ProgressBar(label=f"epoch {epoch + 1}/{config.epochs}", enabled=world.is_main and config.progress)
        after_step = after_step_hook(config=config, world=world, optimizer=optimizer, epoch=epoch, warmup=warmup,
                                     gradients=strategy.named_gradients, save=save,
                                     check_replicas=strategy.check_replicas, stop=stop, survivors=survivors)
        stats = train_epoch(strategy, optimizer, train_images, train_labels, world=world,
                            global_batch_size=config.global_batch_size, seed=config.seed, epoch=epoch,
                            on_step=bar.update, tracer=tracer, start_step=first_step,
                            start_totals=start.epoch_totals if epoch == start.epoch else (), after_step=after_step,
                            graph=graph)
        bar.close()
        if replica is not None:  # the epoch's last steps since the periodic check, before its row is written
            replica.check_finite(where=f"the end of epoch {epoch + 1}")
        with span(tracer, "evaluate"):
            test_acc = count_accuracy(strategy.module, strategy.predict, test_images, test_labels,
                                      rows=strategy.rows(test_images.shape[0]), world=world,
                                      batch_size=config.eval_batch_size)
        row = {"epoch": epoch + 1, "train_loss": stats.train_loss, "train_acc": stats.train_acc, "test_acc": test_acc,
               "epoch_s": stats.elapsed_s, "images_per_s": stats.num_examples / stats.elapsed_s,
               "devices": list(device_names), "global_batch_size": config.global_batch_size, "lr": config.optim.lr,
               "warmup_epochs": config.optim.warmup_epochs, "dtype": config.dtype, **strategy.facts(),
               **mixed_lr(begin, config, epoch), **run_facts(config, dataset=data.name)}
        history.append(row)
        mixed = (f"  (lr {row['lr_before_resume']:g} for its first {row['steps_before_resume']} steps, "
                 f"{config.optim.lr:g} after the resume)" if "lr_before_resume" in row else "")
        log(f"epoch {epoch + 1:3d}  loss {stats.train_loss:.4f}  train acc {stats.train_acc:.3f}  "
            f"test acc {test_acc:.3f}  {stats.elapsed_s:.2f} s  {row['images_per_s']:.0f} img/s{mixed}")
        if metrics is not None:
            metrics.append(row)
        if config.checkpoint.every is not None:
            save(ckpt.Position(epoch=epoch + 1, step=0))

    whole = strategy.whole_model()  # every rank: a split gathers its shards
    streamed = replica is not None and replica.shard == "parameters"  # no rank holds the whole model
    # Seconds per epoch of this device set only: a run resumed on other devices has rows of both.
    timed = [r for r in history if r.get("devices", list(device_names)) == list(device_names)]
    sec_per_epoch = sum(r["epoch_s"] for r in timed) / len(timed) if timed else 0.0
    # Nothing trained in a run that found the training complete: its model's accuracy, counted again.
    final_acc = count_accuracy(strategy.module, strategy.predict, test_images, test_labels,
                               rows=strategy.rows(test_images.shape[0]), world=world,
                               batch_size=config.eval_batch_size) if complete else history[-1]["test_acc"]
    if outputs is not None:
        split = f", split {config.split.kind}" if config.split.kind != "data" else ""
        # The last epoch's checkpoint (if any) holds exactly this model: named if model.pt fails.
        kept = ckpt.checkpoint_path(config.checkpoint_location) if config.checkpoint.every is not None else None
        outputs.finish(history, None if streamed else whole, title=f"{config.model} on {data.name}, "
                       f"{device_spans(history) or devices_text}{split}",
                       checkpoint=kept, write_model=(lambda path: stream_model(replica, path)) if streamed else None)
    elif streamed and config.out_dir:  # rank 0 streams model.pt: every rank gathers each bucket with it
        stream_model(replica, None)
    # The book prints one decimal; under a second that rounds by up to 20% (0.27 read as 0.3, which made
    # `phalanx predict` look 30% off), so a short epoch keeps two.
    timing = (f"{sec_per_epoch:.{2 if sec_per_epoch < 1 else 1}f} sec/epoch" if sec_per_epoch
              else "no epoch trained in this run")
    partial = sec_per_epoch and len(timed) < len(history)
    spans = f" (epochs on these devices: {len(timed)} of {len(history)})" if partial else ""
    named = f" ({data.name})" if data.name != "fashion-mnist" else ""  # the book's line is Fashion-MNIST's
    log(f"test acc{named}: {final_acc:.2f}, {timing} on {devices_text}{spans}")
    return {"history": history, "sec_per_epoch": sec_per_epoch, "dataset": data.name}


def _whole_optimizer(optimizer: torch.optim.Optimizer, strategy: Strategy, whole: torch.nn.Module):
    """The optimizer a checkpoint holds: over the whole model's parameters, so that any split can
    resume it. A replica's own; for a split's shards the same SGD over the whole model at the
    current lr (plain SGD keeps no per-parameter state, so nothing else is lost)."""
    if whole is strategy.module:
        return optimizer
    group = optimizer.param_groups[0]
    return torch.optim.SGD(whole.parameters(), lr=group["lr"], weight_decay=group.get("weight_decay", 0.0))


def _set_capturable(optimizer: torch.optim.Optimizer, capture: bool) -> None:
    """Adam and AdamW keep their step count on the device only when `capturable`, which a CUDA
    graph of their step needs and a CPU run refuses: set per run, whatever a checkpoint held."""
    for group in optimizer.param_groups:
        if "capturable" in group:
            group["capturable"] = capture


def _position_text(position: ckpt.Position, steps: int) -> str:
    if position.step == 0:
        return f"the end of epoch {position.epoch}"
    return f"epoch {position.epoch + 1}, step {position.step} of {steps}"


def _schedule_text(config: TrainConfig) -> str:
    accum_steps, warmup_epochs = config.data_parallel.grad_accum_steps, config.optim.warmup_epochs
    accum = f", {accum_steps} micro-batches per step" if accum_steps > 1 else ""
    warm = f", lr warmup over {warmup_epochs:g} epoch{'' if warmup_epochs == 1 else 's'}" if warmup_epochs else ""
    return accum + warm


def _placement_text(config: TrainConfig, world: World) -> str:
    """CPU threads per worker, and the cores rank 0 was pinned to under --bind-cores."""
    if world.device.type != "cpu":
        return ""
    threads = torch.get_num_threads()
    note = threads_note(threads, flag_given=config.launch.threads_per_device is not None)
    text = f", {threads} thread{'s' if threads > 1 else ''} per worker{note}"
    if config.launch.bind_cores and hasattr(os, "sched_getaffinity"):
        text += f", each bound to its own cores (rank 0: {describe_cores(sorted(os.sched_getaffinity(0)))})"
    return text


def device_spans(history: list[dict]) -> str:
    """"epochs 1-3 on [cpu:0, cpu:1]; epochs 4-5 on [cpu:0]" for rows trained on more than one
    device set (a resume on other devices), else "" (the run's own device list says it)."""
    spans: list[list] = []  # [devices text, first epoch, last epoch]
    for row in history:
        names = f"[{', '.join(row.get('devices', []))}]"
        if spans and spans[-1][0] == names:
            spans[-1][2] = row["epoch"]
        else:
            spans.append([names, row["epoch"], row["epoch"]])
    if len(spans) < 2:
        return ""
    return "; ".join(f"epochs {a}-{b} on {n}" if a != b else f"epoch {a} on {n}" for n, a, b in spans)
