"""The `phalanx` command: parse flags, build configs, run, and turn bad input into one line.

Nothing imports this module (the command's entry point, phalanx.__main__, installs the stop
handlers before it imports this). Every ending a user can act on is one line on stderr, no
traceback: bad input (`UsageError`, a config's `ValueError`) `phalanx: error: <problem>; <fix>`,
exit 2; a checked stop or an output that could not be written (`RunFailed`) `phalanx: run
stopped: ...`, exit 1; a failed worker `phalanx: worker rank R failed: ...` (then every rank's
report), exit 1; Ctrl-C `phalanx: interrupted`, exit 130; SIGTERM/SIGHUP `phalanx: stopped by
SIGTERM; every worker was stopped`, exit 128 + the signal's number.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from phalanx.runtime.binding import allowed_cores, check_bindable
from phalanx.bench import add_bench_parser, run_bench
from phalanx.predict import add_predict_parser, run_predict
from phalanx.runtime.script import add_run_parser, run_run
from phalanx.sweep import add_sweep_parser, run_sweep
from phalanx.verify import add_verify_parser, run_verify
from phalanx.comm import CHOICES
from phalanx.errors import RunFailed, Stopped, UsageError
from phalanx.runtime.lifeline import stop_message
from phalanx.outdir import check_out_dir, check_path_length
from phalanx.models import INITS, MODELS
from phalanx.data_parallel import BATCHNORM_POLICIES, DEFAULT_BUCKET_CAP_MB, MEMORY_FORMATS
from phalanx.job.config import DATASETS, TrainConfig


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors: one line, exit 2
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="phalanx", description="Data-parallel training across k devices.")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    train = sub.add_parser("train", help="train a model on k devices in lockstep")
    train.add_argument("--devices", default="1", help="N, cpu:N or cuda:0,1 (default 1)")
    train.add_argument("--model", default="lenet", help=f"one of {', '.join(MODELS)}")
    train.add_argument("--dataset", default=None, help=f"one of {', '.join(DATASETS)} (default fashion-mnist)")
    train.add_argument("--data-dir", default=None, help="directory with the four IDX files")
    train.add_argument("--epochs", type=int, default=10)
    train.add_argument("--batch-size", type=int, default=256, help="global batch, split over the devices")
    train.add_argument("--lr", type=float, default=0.2)
    train.add_argument("--warmup-epochs", type=float, default=0.0,
                       help="raise the lr linearly from lr/steps to lr over this many epochs (default 0: none)")
    train.add_argument("--allreduce", default="auto",
                       help=f"one of {', '.join(CHOICES)} (auto: shm for CPU workers on one host, else native)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--init", default="pytorch", help=f"one of {', '.join(INITS)} (book: normal(0, 0.01))")
    train.add_argument("--dtype", default="float32", help="float32, or float64 for exact equivalence checks")
    train.add_argument("--out", default=None, help="write metrics.jsonl, accuracy.png, model.pt here")
    train.add_argument("--threads-per-device", type=int, default=None, help="CPU threads per worker")
    train.add_argument("--bind-cores", action="store_true",
                       help="pin each local worker to its own equal share of the cores (threads = its share)")
    train.add_argument("--timeout", type=float, default=120.0, help="seconds any collective may wait")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument("--no-overlap", action="store_true",
                       help="exchange gradients in one synchronous allreduce after backward "
                            "(default: bucketed allreduces overlapped with backward)")
    train.add_argument("--bucket-cap-mb", type=_bucket_cap, default=DEFAULT_BUCKET_CAP_MB,
                       help=f"gradient bucket cap in MB with overlap, or 'none' for one bucket "
                            f"(default {DEFAULT_BUCKET_CAP_MB})")
    train.add_argument("--grad-dtype", default=None,
                       help="exchange gradients compressed to bf16 or fp16 (half the bytes; default: as computed)")
    train.add_argument("--grad-accum", type=int, default=1,
                       help="micro-batches per global batch; gradients are exchanged once per batch (default 1)")
    train.add_argument("--memory-format", default="auto", help=f"one of {', '.join(MEMORY_FORMATS)} "
                       "(auto: channels_last for conv nets on CPU, ~1.5x faster steps)")
    train.add_argument("--batchnorm", default="sync", help=f"BatchNorm models: {' or '.join(BATCHNORM_POLICIES)} "
                       "(sync: whole-batch statistics, k devices == 1 device; local: per-device statistics)")
    train.add_argument("--trace", default=None, metavar="DIR",
                       help="write a Chrome trace per rank and a communication summary into DIR")
    train.add_argument("--trace-steps", type=int, default=20, help="steps traced per epoch with --trace (default 20)")
    train.add_argument("--checkpoint-every", default=None, metavar="N|epoch",
                       help="save a checkpoint every N steps (and at every epoch end), or at epoch ends only")
    train.add_argument("--checkpoint-dir", default=None, help="where checkpoints go (default OUT/checkpoints)")
    train.add_argument("--resume", default=None, metavar="DIR|auto",
                       help="continue from a checkpoint (dir or file); auto: the checkpoint dir's, if any")
    train.add_argument("--overwrite", action="store_true",
                       help="replace an earlier run's outputs in --out / the checkpoint dir (default: refuse)")
    train.add_argument("--max-restarts", type=int, default=0, metavar="N",
                       help="restart the workers from the last checkpoint after a worker fails, up to N times "
                            "(needs --checkpoint-every; default 0)")
    train.add_argument("--elastic", action="store_true",
                       help="with --max-restarts: go on without a device whose worker fails again before the "
                            "run gets past the checkpoint it restarted from")
    train.add_argument("--check-every", type=int, default=100,
                       help="steps between replica-identity and finite-gradient checks (0: off; default 100)")
    train.add_argument("--split", default="data", help="data (replicas, default), layers (a pipeline of LeNet's "
                       "layers) or channels (every layer's output channels split over the devices)")
    train.add_argument("--micro-batches", type=int, default=None,
                       help="--split layers: micro-batches each global batch is cut into (default 2 x devices)")
    train.add_argument("--schedule", default="gpipe", help="--split layers: gpipe (all forwards, then all "
                       "backwards) or 1f1b (one forward, one backward: fewer activations held)")
    add_bench_parser(sub)
    add_verify_parser(sub)
    add_predict_parser(sub)
    add_sweep_parser(sub)
    add_run_parser(sub)
    return parser


def _train(args: argparse.Namespace) -> int:
    # Imported here so `phalanx --help` does not pay for torch's import.
    from phalanx.data import load_dataset
    from phalanx.runtime.devices import parse_devices
    from phalanx.runtime.launch import LaunchSpec
    from phalanx.telemetry import RankZeroLog
    from phalanx.job.dirlock import hold_run_directories
    from phalanx.job.elastic import train_with_restarts
    from phalanx.runtime.world import launcher_env

    try:
        config = _config_from_args(args)
    except ValueError as exc:  # the config names the numbers; it is the user's to fix
        raise UsageError(str(exc)) from None
    check_out_dir(config.out_dir)
    check_out_dir(config.trace_dir, flag="--trace")
    check_out_dir(config.checkpoint_dir, flag="--checkpoint-dir")
    check_path_length(config.data_dir, flag="--data-dir")
    env = launcher_env()
    plan = parse_devices(args.devices)
    if env is not None:  # torchrun decides the count; --devices only picks cpu or cuda
        kind = plan.kind
        plan = parse_devices(f"cuda:{','.join(map(str, range(env.local_world_size)))}" if kind == "cuda"
                             else f"cpu:{env.world_size}")
    try:
        config.check_devices(plan.num_devices)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if config.bind_cores and env is None:  # before the data is read: one line, nothing started
        check_bindable(plan.num_devices, len(allowed_cores()))
    if env is not None and config.max_restarts:
        raise UsageError("under torchrun, restarts are torchrun's: pass --max-restarts to torchrun, "
                         "not to phalanx train")
    # One run per output directory: held from here (before any worker) until the run is over.
    with hold_run_directories(config, enabled=env is None or env.rank == 0):
        if env is None and plan.num_devices > 1:
            # Check (and download) the data once here, so bad data is one line from one process
            # and the workers find it cached; resolve the fallback so every worker agrees.
            data = load_dataset(config.dataset, config.data_dir, log=RankZeroLog(enabled=True))
            config = replace(config, dataset=data.name, data_dir=data.data_dir)
        names = plan.names if env is None else _torchrun_names(plan, env.world_size)
        train_with_restarts(config, names, spec=LaunchSpec(plan=plan, threads_per_device=config.threads_per_device,
                                                           timeout_s=config.timeout_s, bind_cores=config.bind_cores))
    return 0


def _config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        model=args.model,
        dataset=args.dataset,
        data_dir=args.data_dir,
        epochs=args.epochs,
        global_batch_size=args.batch_size,
        lr=args.lr,
        warmup_epochs=args.warmup_epochs,
        allreduce=args.allreduce,
        seed=args.seed,
        init=args.init,
        out_dir=args.out,
        threads_per_device=args.threads_per_device,
        bind_cores=args.bind_cores,
        timeout_s=args.timeout,
        progress=not args.no_progress,
        dtype=args.dtype,
        overlap=not args.no_overlap,
        bucket_cap_mb=args.bucket_cap_mb,
        grad_dtype=args.grad_dtype,
        grad_accum_steps=args.grad_accum,
        memory_format=args.memory_format,
        batchnorm=args.batchnorm,
        trace_dir=args.trace,
        trace_steps=args.trace_steps,
        checkpoint_every=args.checkpoint_every,
        checkpoint_dir=args.checkpoint_dir,
        resume=args.resume,
        overwrite=args.overwrite,
        max_restarts=args.max_restarts,
        elastic=args.elastic,
        check_every=args.check_every,
        split=args.split,
        micro_batches=args.micro_batches,
        schedule=args.schedule,
    )


def _bucket_cap(text: str) -> float | None:
    if text.lower() == "none":
        return None
    return float(text)  # argparse turns a ValueError into a one-line usage error


_bucket_cap.__name__ = "MB (or 'none')"  # what argparse names in "invalid ... value"


def _torchrun_names(plan, world_size: int) -> tuple[str, ...]:
    return tuple(f"{plan.kind}:{i}" for i in range(world_size))


def main(argv: list[str] | None = None) -> int:
    try:
        return _run_command(argv)
    except UsageError as exc:
        print(f"phalanx: error: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:  # one device runs in this process: its checked stops arrive here
        print(f"phalanx: run stopped: {exc}", file=sys.stderr)
        return exc.exit_code
    except (KeyboardInterrupt, Stopped) as exc:
        line, code = stop_message(exc)
        print(line, file=sys.stderr)
        return code
    except Exception as exc:
        from phalanx.runtime.launch import WorkerFailed

        if isinstance(exc, WorkerFailed):
            print(f"phalanx: {exc}", file=sys.stderr)
            return 1
        raise


def _run_command(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    commands = {"train": _train, "bench": run_bench, "verify": run_verify, "predict": run_predict,
                "sweep": run_sweep, "run": run_run}
    if args.command not in commands:
        raise UsageError(f"unknown command {args.command!r}")
    return commands[args.command](args)
