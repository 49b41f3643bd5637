"""`phalanx sweep`: its parser (generated from `SweepConfig`) and its runner.

`add_sweep_arguments` fills the subcommand's parser from the config (every flag, default and
check declared once, on its fields: phalanx/options.py); `run_sweep` builds the config, trains
the grid, prints the table and writes sweep.json, sweep.csv and sweep.png into `--out`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from phalanx.errors import UsageError
from phalanx.options import add_options, build
from phalanx.outdir import check_out_dir
from phalanx.sweep.grid import SweepConfig, expand_grid


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(parser, SweepConfig)


def run_sweep(args: argparse.Namespace) -> int:
    """Train the grid `args` describes: table to stdout, JSON + CSV + PNG into --out. Returns 0."""
    config = build(SweepConfig, args)
    check_out_dir(config.out_dir)
    _keep_earlier_outputs(config)
    # Imported here so the CLI's parser does not load matplotlib.
    from phalanx.measure.outputs import write_outputs
    from phalanx.runtime.binding import available_cores
    from phalanx.sweep.report import csv_bytes, format_table, oversubscription_note, plot_sweep
    from phalanx.sweep.run import run_grid

    points = expand_grid(config)
    print(f"phalanx sweep: {len(points)} points x {config.epochs} epochs "
          f"(k in {list(config.num_devices)}, b in {list(config.batch_sizes_per_device)}, "
          f"lr rules {[str(r) for r in config.lr_rules]})", flush=True)
    start_s = time.perf_counter()
    rows = run_grid(config)
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


def _keep_earlier_outputs(config: SweepConfig) -> None:
    """Refuse an --out holding an earlier sweep's outputs unless this one reuses them (--resume) or
    replaces them (--overwrite: deleted first, so no earlier point mixes in), as `train` does."""
    out = Path(config.out_dir)
    earlier = [out / f"sweep.{suffix}" for suffix in ("json", "csv", "png")] + sorted((out / "points").glob("*.json"))
    earlier = [path for path in earlier if path.is_file()]
    if not earlier or config.resume:
        return
    if not config.overwrite:
        points = sum(path.parent.name == "points" for path in earlier)
        names = ", ".join([p.name for p in earlier if p.parent == out] + ([f"{points} points"] if points else []))
        raise UsageError(f"--out {out} holds an earlier sweep's outputs ({names}); reuse its finished points with "
                         "--resume, or replace them with --overwrite")
    for path in earlier:
        path.unlink(missing_ok=True)
