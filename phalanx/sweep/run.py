"""Train every point of a sweep and summarize each run: final and best accuracy, time to target.

One launch per device count k: its k workers train all of k's points one after another with
`phalanx train`'s own worker (`train_worker`), so each point is exactly a `phalanx train` run,
while the ~2-13 s start-up of k fresh interpreters (measured here: 4 workers on 2 busy cores,
mostly `import torch`) is paid once per k instead of once per point. Rank 0 writes each point's
result to `points/<key>.json` as soon as it finishes (atomically), so an interrupted sweep loses
at most the point in flight and `--resume` picks up the rest.

Time to target is the cumulative *training* time (the sum of epoch times; no start-up, no
evaluation) up to the end of the first epoch whose test accuracy reaches the target.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from phalanx.atomic import atomic_write_bytes
from phalanx.runtime.devices import parse_devices
from phalanx.runtime.launch import LaunchSpec, launch
from phalanx.sweep.grid import GridPoint, SweepConfig, expand_grid, train_config
from phalanx.job.config import TrainConfig
from phalanx.job.job import train_worker
from phalanx.runtime.world import World

POINTS_DIR = "points"


def time_to_target(history: Sequence[dict[str, Any]], target_acc: float) -> tuple[float | None, int | None]:
    """(training seconds, epoch) at the end of the first epoch with test acc >= target, or (None, None)."""
    elapsed_s = 0.0
    for row in history:
        elapsed_s += row["epoch_s"]
        if row["test_acc"] >= target_acc:
            return elapsed_s, row["epoch"]
    return None, None


def summarize(point: GridPoint, history: Sequence[dict[str, Any]], *, target_acc: float, settings: dict,
              dataset: str) -> dict[str, Any]:
    """One point's row: the grid coordinates, the headline numbers, and the per-epoch curve."""
    if not history:
        raise ValueError(f"point {point.key} trained no epoch")
    seconds, epoch = time_to_target(history, target_acc)
    return {
        **point.to_dict(),
        "key": point.key,
        "dataset": dataset,
        "final_test_acc": history[-1]["test_acc"],
        "best_test_acc": max(r["test_acc"] for r in history),
        "time_to_target_s": seconds,
        "epochs_to_target": epoch,
        "sec_per_epoch": sum(r["epoch_s"] for r in history) / len(history),
        "history": [{k: r[k] for k in ("epoch", "train_loss", "train_acc", "test_acc", "epoch_s")} for r in history],
        "settings": settings,
    }


def point_settings(train: TrainConfig, point: GridPoint) -> dict[str, Any]:
    """What decides a point's outcome: a stored result is reused by --resume only if these match."""
    return {"num_devices": point.num_devices, "model": train.model, "dataset": train.data.dataset,
            "data_dir": train.data.directory, "epochs": train.epochs, "global_batch_size": train.global_batch_size,
            "lr": train.optim.lr, "warmup_epochs": train.optim.warmup_epochs, "seed": train.seed,
            "threads_per_device": train.launch.threads_per_device,
            **({} if train.data.train_examples is None else {"train_examples": train.data.train_examples})}


def sweep_worker(world: World, jobs: Sequence[tuple[GridPoint, TrainConfig, dict]], names: Sequence[str],
                 target_acc: float, points_dir: str | None) -> list:
    """Run in each of k workers: train the jobs in order; rank 0 returns (and writes) their rows."""
    rows = []
    for index, (point, train, settings) in enumerate(jobs):
        # train_worker logs every epoch on rank 0; the sweep reports one line per point instead.
        with contextlib.redirect_stdout(io.StringIO()):
            result = train_worker(world, train, names)
        if not world.is_main:
            continue
        row = summarize(point, result["history"], target_acc=target_acc, settings=settings, dataset=result["dataset"])
        if points_dir is not None:
            atomic_write_bytes(Path(points_dir) / f"{point.key}.json", (json.dumps(row, indent=1) + "\n").encode())
        rows.append(row)
        _stderr(f"{point.key}: final test acc {row['final_test_acc']:.3f}, "
                              f"{row['sec_per_epoch']:.2f} s/epoch ({index + 1}/{len(jobs)} on {world.world_size} "
                              f"device{'s' if world.world_size > 1 else ''})")
    return rows


def _stderr(message: str) -> None:
    print(f"phalanx sweep: {message}", file=sys.stderr, flush=True)


def load_stored(points_dir: Path, key: str, settings: dict) -> dict | None:
    """A finished point's row from an earlier run of the same settings, or None."""
    path = points_dir / f"{key}.json"
    try:
        row = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return row if row.get("settings") == settings else None


def run_grid(config: SweepConfig, *, progress: Callable[[str], None] = _stderr) -> list[dict[str, Any]]:
    """Train the whole grid (data loaded and checked once, here); the rows in grid order."""
    # Resolve the dataset once, so bad data is one line from this process and every point trains
    # on the same data (an unnamed fashion-mnist may fall back to digits offline).
    data = config.data.load(log=progress)
    resolved = config.data.resolved(data)
    points_dir = Path(config.out_dir) / POINTS_DIR
    points_dir.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict] = {}
    by_devices: dict[int, list] = {}
    for point in expand_grid(config):
        train = train_config(config, point, data=resolved)
        settings = point_settings(train, point)
        stored = load_stored(points_dir, point.key, settings) if config.resume else None
        if stored is not None:
            rows[point.key] = {**stored, "reused": True}
            progress(f"{point.key}: reusing the stored result (--resume)")
        else:
            by_devices.setdefault(point.num_devices, []).append((point, train, settings))
    for num_devices, jobs in by_devices.items():
        plan = parse_devices(f"cpu:{num_devices}")
        progress(f"{len(jobs)} point(s) on {num_devices} CPU worker(s)")
        # spawn_single: k = 1 runs in a worker too, set up as k > 1 ones are (comparable s/epoch).
        spec = LaunchSpec(plan=plan, threads_per_device=config.threads_per_device, timeout_s=config.timeout_s,
                          spawn_single=True)
        results = launch(sweep_worker, jobs, plan.names, config.target_acc, str(points_dir), spec=spec)
        for row in results[0]:
            rows[row["key"]] = {**row, "reused": False}
    # A stored row keeps its curve; its time to target is recomputed for this run's --target.
    ordered = with_target([rows[point.key] for point in expand_grid(config)], config.target_acc)
    return [{**row, "num_classes": data.num_classes} for row in ordered]


def with_target(rows: Sequence[dict[str, Any]], target_acc: float) -> list[dict[str, Any]]:
    """Rows recomputed for another target (a stored row may have been made with a different one)."""
    out = []
    for row in rows:
        seconds, epoch = time_to_target(row["history"], target_acc)
        out.append({**row, "time_to_target_s": seconds, "epochs_to_target": epoch})
    return out


__all__ = ["POINTS_DIR", "load_stored", "point_settings", "run_grid", "summarize", "sweep_worker",
           "time_to_target", "train_config", "with_target"]
