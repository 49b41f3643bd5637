"""`phalanx verify`: flags onto a `VerifyConfig`, a model and a dataset; the report; the exit code.

`add_verify_parser(subparsers)` adds the subcommand to the CLI's parser, `run_verify(args)` runs
it: 0 when every k agrees with 1 device, 1 when one does not (usable in CI), and bad input is a
one-line `UsageError`. `--plant` puts a known bug into the k-device runs so the diagnosis can be
seen at work: `rank-mean` (each rank's mean loss / k: wrong on uneven shards), `rank-sum` (the
ranks' means summed: k x the gradient), `shuffle-per-rank` (each rank draws its own data order).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

from phalanx.comm import CHOICES
from phalanx.data_parallel import BATCHNORM_POLICIES, GRAD_DTYPES
from phalanx.errors import UsageError
from phalanx.measure.flags import parse_list
from phalanx.outdir import check_out_file
from phalanx.verify.config import DEFAULT_GLOBAL_BATCH_SIZE, DTYPES, VerifyConfig

PLANTS = ("none", "rank-mean", "rank-sum", "shuffle-per-rank")


def add_verify_parser(subparsers) -> argparse.ArgumentParser:
    """Add `verify` to an argparse subparsers object; return its parser."""
    verify = subparsers.add_parser("verify", help="check that k-device training equals 1-device training, step by step")
    verify.add_argument("--model", default="lenet", help="lenet, lenet-bn, resnet or mlp (default lenet)")
    verify.add_argument("--devices", default="2,3", help="device counts k compared with 1 device (default 2,3)")
    verify.add_argument("--device", default="cpu", help="cpu (k worker processes) or cuda (k GPUs); default cpu")
    verify.add_argument("--steps", type=int, default=5, help="SGD steps compared (default 5)")
    verify.add_argument("--batch-size", type=int, default=DEFAULT_GLOBAL_BATCH_SIZE,
                        help=f"global batch (default {DEFAULT_GLOBAL_BATCH_SIZE}: a prime, uneven over every k)")
    verify.add_argument("--lr", type=float, default=0.2)
    verify.add_argument("--seed", type=int, default=0)
    verify.add_argument("--dtype", default="float64", help=f"one of {', '.join(DTYPES)} (default float64: exact)")
    verify.add_argument("--tolerance", type=float, default=None,
                        help="relative difference allowed per tensor (default 1e-9 in float64, 1e-3 in float32)")
    verify.add_argument("--allreduce", default="auto", help=f"one of {', '.join(CHOICES)}")
    verify.add_argument("--no-overlap", action="store_true", help="one synchronous allreduce after backward")
    verify.add_argument("--batchnorm", default="sync", help=f"BatchNorm models: {' or '.join(BATCHNORM_POLICIES)}")
    verify.add_argument("--grad-dtype", default=None,
                        help=f"exchange gradients compressed to {' or '.join(GRAD_DTYPES)} and measure the error")
    verify.add_argument("--plant", default="none", help=f"plant a known bug: {', '.join(PLANTS)}")
    verify.add_argument("--dataset", default="synthetic", help="synthetic (default), fashion-mnist or digits")
    verify.add_argument("--data-dir", default=None, help="directory with the four Fashion-MNIST IDX files")
    verify.add_argument("--timeout", type=float, default=60.0, help="seconds any collective may wait")
    verify.add_argument("--no-diagnose", action="store_true", help="on failure, do not rerun probes to name a cause")
    verify.add_argument("--out", default=None, metavar="FILE", help="also write the report as JSON to FILE")
    verify.add_argument("--split", default="data", help="data (default), layers or channels: which way k devices "
                        "share the model (layers and channels: --model lenet)")
    verify.add_argument("--micro-batches", type=int, default=None, help="--split layers: micro-batches (default 2k)")
    verify.add_argument("--schedule", default="gpipe", help="--split layers: gpipe or 1f1b")
    return verify


def run_verify(args: argparse.Namespace) -> int:
    """Run the comparison `args` describes; print the report; 0 pass, 1 fail."""
    # Imported here so the CLI's parser does not pay for torch.
    from phalanx.atomic import atomic_write_bytes
    from phalanx.data import load_dataset
    from phalanx.models import MODELS, build_model
    from phalanx.verify.api import verify

    if args.model not in MODELS:
        raise UsageError(f"unknown model {args.model!r}; choose one of {', '.join(MODELS)}")
    if args.plant not in PLANTS:
        raise UsageError(f"--plant {args.plant!r} is unknown; choose one of {', '.join(PLANTS)}")
    check_out_file(args.out)
    out = None if args.out is None else Path(args.out)
    try:
        config = VerifyConfig(
            world_sizes=parse_list(args.devices, int, flag="--devices"), steps=args.steps,
            global_batch_size=args.batch_size, lr=args.lr, seed=args.seed, dtype=args.dtype,
            tolerance=args.tolerance, algorithm=args.allreduce,
            overlap=not args.no_overlap, batchnorm=args.batchnorm, grad_dtype=args.grad_dtype,
            loss_scale=args.plant if args.plant in ("rank-mean", "rank-sum") else "global",
            shuffle_per_rank=args.plant == "shuffle-per-rank", device=args.device, timeout_s=args.timeout,
            diagnose=not args.no_diagnose)
    except ValueError as exc:  # the config names the numbers: the user's to fix
        raise UsageError(str(exc)) from None
    examples = max(config.steps * config.global_batch_size, config.global_batch_size)
    dataset = load_dataset(args.dataset, args.data_dir, synthetic_sizes=(examples, 1), log=_progress)
    model_fn = functools.partial(build_model, args.model, num_classes=dataset.num_classes)
    title = f"{args.model} on {dataset.name}" + (f" with planted {args.plant}" if args.plant != "none" else "")
    try:
        if args.split != "data":  # the model-parallel splits (issue 13): their own k-device run
            from phalanx.model_split.splits import SCHEDULES
            from phalanx.verify.split import verify_split

            if args.schedule not in SCHEDULES:  # before any worker starts: one line
                raise UsageError(f"--schedule {args.schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}")
            if args.plant != "none":
                raise UsageError(f"--plant plants data-parallel bugs; drop it with --split {args.split}")
            report = verify_split(model_fn, (dataset.train_images, dataset.train_labels), split=args.split,
                                  config=config, micro_batches=args.micro_batches, schedule=args.schedule,
                                  title=f"{title}, split {args.split}", log=_progress)
        else:
            report = verify(model_fn, (dataset.train_images, dataset.train_labels), config=config, title=title,
                            log=_progress)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print(report.render(), flush=True)
    if out is not None:
        atomic_write_bytes(out, (json.dumps(report.to_dict(), indent=2) + "\n").encode())
        print(f"wrote {out}")
    return 0 if report.passed else 1


def _progress(message: str) -> None:
    print(f"phalanx verify: {message}", file=sys.stderr, flush=True)
