"""`phalanx sweep`: the chapter's exercises 1 and 2 - devices × per-device batch × learning rate.

Trains `phalanx train`'s job over a grid of device counts k, per-device batches b (global batch
k·b) and lr rules (numbers, or `scaled`: the linear-scaling rule with warmup), then prints a
table and writes sweep.json, sweep.csv and sweep.png (final test accuracy and time to a target
accuracy over the global batch) into `--out` (default runs/sweep), plus each point's row under
`points/` as it finishes (what `--resume` reuses). grid.py holds the config and the grid,
run.py the training, report.py the outputs. This module only maps flags onto the config:
`add_sweep_parser(subparsers)` adds the subcommand, `run_sweep(args)` runs it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from phalanx.errors import UsageError
from phalanx.outdir import check_out_dir


def add_sweep_parser(subparsers) -> argparse.ArgumentParser:
    """Add `sweep` to an argparse subparsers object; return its parser."""
    sweep = subparsers.add_parser("sweep", help="train over devices x per-device batch x lr; plot accuracy and time")
    sweep.add_argument("--devices", default="1,2,4", help="CPU worker counts k (default 1,2,4)")
    sweep.add_argument("--per-device-batch", default="32,128",
                       help="batch per device b; the global batch is k*b (default 32,128)")
    sweep.add_argument("--lr", default="0.1,0.2,scaled",
                       help="lr rules: numbers and/or 'scaled' = base-lr * k*b / base-batch with warmup "
                            "(default 0.1,0.2,scaled)")
    sweep.add_argument("--base-lr", type=float, default=0.1, help="lr at the base batch for 'scaled' (default 0.1)")
    sweep.add_argument("--base-batch", type=int, default=32, help="global batch of base-lr (default 32)")
    sweep.add_argument("--warmup-epochs", type=float, default=1.0,
                       help="linear lr warmup of 'scaled' points whose lr exceeds base-lr (default 1)")
    sweep.add_argument("--epochs", type=int, default=10, help="epochs per point (default 10)")
    sweep.add_argument("--target", type=float, default=0.7, help="test accuracy for time-to-target (default 0.7)")
    sweep.add_argument("--model", default="lenet")
    sweep.add_argument("--dataset", default=None, help="fashion-mnist (default), digits or synthetic")
    sweep.add_argument("--data-dir", default=None, help="directory with the four IDX files")
    sweep.add_argument("--seed", type=int, default=0)
    sweep.add_argument("--threads-per-device", type=int, default=1, help="CPU threads per worker (default 1)")
    sweep.add_argument("--timeout", type=float, default=120.0, help="seconds any collective may wait")
    sweep.add_argument("--out", default="runs/sweep", help="directory for the outputs (default runs/sweep)")
    sweep.add_argument("--resume", action="store_true",
                       help="reuse points already finished in --out with the same settings")
    return sweep


def sweep_config_from_args(args: argparse.Namespace):
    from phalanx.measure.flags import parse_list
    from phalanx.sweep.grid import SweepConfig, parse_lr_rule

    try:
        return SweepConfig(
            num_devices=parse_list(args.devices, int, flag="--devices"),
            batch_sizes_per_device=parse_list(args.per_device_batch, int, flag="--per-device-batch"),
            lr_rules=parse_list(args.lr, parse_lr_rule, flag="--lr"),
            base_lr=args.base_lr, base_batch=args.base_batch, warmup_epochs=args.warmup_epochs,
            epochs=args.epochs, target_acc=args.target, model=args.model, dataset=args.dataset,
            data_dir=args.data_dir, seed=args.seed, threads_per_device=args.threads_per_device,
            timeout_s=args.timeout, out_dir=args.out)
    except ValueError as exc:  # the config names the offending numbers: the user's to fix
        raise UsageError(str(exc)) from None


def run_sweep(args: argparse.Namespace) -> int:
    """Train the grid `args` describes: table to stdout, JSON + CSV + PNG into --out. Returns 0."""
    config = sweep_config_from_args(args)
    check_out_dir(config.out_dir)
    # Imported here so the CLI's parser does not load torch or matplotlib.
    from phalanx.runtime.binding import available_cores
    from phalanx.sweep.grid import expand_grid
    from phalanx.measure.outputs import write_outputs
    from phalanx.sweep.report import csv_bytes, format_table, oversubscription_note, plot_sweep
    from phalanx.sweep.run import run_grid

    points = expand_grid(config)
    print(f"phalanx sweep: {len(points)} points x {config.epochs} epochs "
          f"(k in {list(config.num_devices)}, b in {list(config.batch_sizes_per_device)}, "
          f"lr rules {[str(r) for r in config.lr_rules]})", flush=True)
    start_s = time.perf_counter()
    rows = run_grid(config, resume=args.resume)
    wall_s = time.perf_counter() - start_s
    cores = available_cores()
    dataset = rows[0]["dataset"]
    print(format_table(rows, target_acc=config.target_acc, cores=cores), flush=True)
    payload = {"sweep": "devices x per-device batch x lr", "config": config.to_dict(), "cores": cores,
               "dataset": dataset, "wall_s": wall_s, "note": oversubscription_note(rows, cores), "results": rows}
    fig = plot_sweep(rows, target_acc=config.target_acc, epochs=config.epochs,
                     title=f"{config.model} on {dataset}, {config.epochs} epochs, scaled: lr = {config.base_lr:g} "
                           f"× global / {config.base_batch}")
    paths = write_outputs(Path(config.out_dir), "sweep", payload, fig, also={"csv": csv_bytes(rows)})
    reused = sum(row["reused"] for row in rows)
    print(f"\nwrote {', '.join(map(str, paths))} ({wall_s:.0f} s"
          + (f"; {reused} of {len(rows)} points reused from earlier runs)" if reused else ")"))
    return 0


__all__ = ["add_sweep_parser", "run_sweep", "sweep_config_from_args"]
