"""`phalanx train`: its parser (generated from TrainConfig) and its runner, the job's thin entry point.

`add_train_arguments` fills the subcommand's parser from `TrainConfig` and its components (every
flag, help and default declared once, beside the code it configures: phalanx/options.py);
`run_train` checks what can be checked before any process starts (output paths, the checkpoint
--resume names, devices, core binding), holds the run's directories, and runs the job with
restarts (elastic.py).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from phalanx.errors import UsageError
from phalanx.job.auto_devices import resolve_auto
from phalanx.job.config import TrainConfig
from phalanx.job.dirlock import hold_run_directories
from phalanx.job.elastic import train_with_restarts
from phalanx.job.resume import check_named_checkpoint
from phalanx.options import add_options, build
from phalanx.outdir import check_out_dir, check_path_length
from phalanx.runtime.binding import allowed_cores, check_bindable
from phalanx.runtime.devices import AUTO, CPU_AUTO, DevicePlan, parse_devices
from phalanx.runtime.host_limits import check_limits, check_temp_dir
from phalanx.runtime.launch import check_loopback
from phalanx.runtime.launcher_flags import add_launcher_flags
from phalanx.runtime.slurm import alone_in_slurm_step
from phalanx.runtime.world import launcher_env
from phalanx.telemetry import RankZeroLog, survive_lost_output

DESCRIPTION = """\
Train a model on k devices in lockstep: every device holds a replica (or, with --split, a share of
the model), every step one global batch is split over them, and the summed gradient keeps the
replicas identical, so k devices compute the 1-device update.

example: phalanx train --devices cpu:2 --epochs 3 --out runs/lenet
"""
EPILOG = "Each flag and what it does: docs/command.md."


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description, parser.epilog = DESCRIPTION, EPILOG
    add_options(parser, TrainConfig)
    add_launcher_flags(parser, command="train")  # torchrun's --nproc-per-node, ...: one line naming --devices


def run_train(args: argparse.Namespace) -> int:
    survive_lost_output()  # the launcher's own lines too (the summary at the end)
    config = build(TrainConfig, args)
    env = launcher_env()
    if env is None:  # before any output path is looked at: every task would write the same ones
        alone_in_slurm_step()
    check_out_dir(config.out_dir)
    check_out_dir(config.trace_dir, flag="--trace")
    check_out_dir(config.checkpoint.directory, flag="--checkpoint-dir")
    check_path_length(config.data.directory, flag="--data-dir")
    check_temp_dir()  # torch itself needs one: refused before any data is read or worker started
    if env is None:  # a checkpoint no worker could read; under torchrun each rank reads it first thing anyway
        check_named_checkpoint(config)
    data = None
    devices = config.launch.devices.strip().lower()
    auto = devices in (AUTO, CPU_AUTO)
    if auto and env is None and (devices == CPU_AUTO or not torch.cuda.is_available()):
        # The probe needs the model's classes: read (or download) the data now, as a run of
        # several devices does below anyway. What it chose, from what, is the run's first line.
        data = config.data.load(log=RankZeroLog(enabled=True))
        config = replace(config, data=config.data.resolved(data))
        config, line = resolve_auto(config, data)
        RankZeroLog(enabled=True)(line)
    if auto and env is not None:  # torchrun decides the count; auto picks the kind
        plan = parse_devices("cuda:0" if devices == AUTO and torch.cuda.is_available() else "cpu:1")
    else:
        plan = parse_devices(config.launch.devices)
    if env is not None:  # torchrun decides the count; --devices only picks cpu or cuda
        kind = plan.kind
        plan = parse_devices(f"cuda:{','.join(map(str, range(env.local_world_size)))}" if kind == "cuda"
                             else f"cpu:{env.world_size}")
    try:
        config.check_devices(plan.num_devices)
        config.graph_plan(plan.kind, plan.num_devices)  # --cuda-graphs on that cannot be honoured: refused now
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if config.launch.bind_cores and env is None:  # before the data is read: one line, nothing started
        check_bindable(plan.num_devices, len(allowed_cores()))
    if env is not None and config.restarts.max_restarts:
        raise UsageError("under torchrun, restarts are torchrun's: pass --max-restarts to torchrun, "
                         "not to phalanx train")
    if env is None and plan.num_devices > 1:  # the workers meet on 127.0.0.1: refused before the data is read
        check_loopback()
        check_limits(plan.num_devices)
    # One run per output directory: held from here (before any worker) until the run is over.
    with hold_run_directories(config, enabled=env is None or env.rank == 0):
        if env is None and plan.num_devices > 1 and data is None:
            # Check (and download) the data once here, so bad data is one line from one process
            # and the workers find it cached; resolve the fallback so every worker agrees.
            data = config.data.load(log=RankZeroLog(enabled=True))
            config = replace(config, data=config.data.resolved(data))
        names = plan.names if env is None else _torchrun_names(plan, env.world_size)
        train_with_restarts(config, names, spec=config.launch.spec(plan))
    return 0


def _torchrun_names(plan: DevicePlan, world_size: int) -> tuple[str, ...]:
    return tuple(f"{plan.kind}:{i}" for i in range(world_size))
