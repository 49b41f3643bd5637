"""A user's script gets what `phalanx train` writes: a progress bar and per-epoch metrics files.

`MetricsLogger(out_dir, world=world)` appends one flat row per call to `out_dir/metrics.jsonl`
through the same `MetricsFile` the trainer uses (rewritten atomically, so a crash never leaves a
torn line; unit-suffixed keys by convention, `epoch_s`), and writes every numeric value as a
TensorBoard scalar under `out_dir` when the optional `tensorboard` package is installed
(`pip install phalanx[tensorboard]`; `tensorboard=True` insists, False never tries).
`progress(iterable, world=world, label=...)` draws the trainer's `ProgressBar` over a loop.
Only rank 0 writes or draws; the other ranks' calls do nothing, so a script calls them on every
rank without `if rank == 0`. Values should already be global (`phalanx.reduce`): this module
knows nothing of ranks beyond `world.is_main`, and never communicates.
"""

from __future__ import annotations

import json
import numbers
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Protocol, TextIO

from phalanx.atomic import make_dir
from phalanx.errors import UsageError
from phalanx.telemetry.metrics import MetricsFile
from phalanx.telemetry.progress import ProgressBar


class Main(Protocol):
    """What reporting needs of a `phalanx.World` (telemetry sits below runtime/world.py)."""

    is_main: bool


def _summary_writer(required: bool):
    """torch's TensorBoard SummaryWriter class, or None when `tensorboard` is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # needs the optional `tensorboard` package
    except ImportError:
        if required:
            raise UsageError("tensorboard=True but the tensorboard package is not installed; "
                             "pip install 'phalanx[tensorboard]' (or tensorboard), or pass tensorboard=None") from None
        return None
    return SummaryWriter


class MetricsLogger:
    """metrics.jsonl (and TensorBoard events) under `out_dir`, written by rank 0; see the module docstring."""

    def __init__(self, out_dir: str | os.PathLike, *, world: Main, tensorboard: bool | None = None,
                 start_epoch: int = 0) -> None:
        """`tensorboard`: None writes events when the package is there, True requires it, False
        never. `start_epoch` > 0 (a resumed run): keep the existing rows up to that epoch, as
        `phalanx train` does; 0 starts the file afresh."""
        if start_epoch < 0:
            raise ValueError(f"start_epoch {start_epoch} must be >= 0")
        self.out_dir = Path(out_dir)
        self.enabled = bool(world.is_main)
        self.metrics: MetricsFile | None = None
        self.writer = None
        if not self.enabled:
            return
        writer_cls = None if tensorboard is False else _summary_writer(required=tensorboard is True)
        make_dir(self.out_dir, named="MetricsLogger's out_dir")
        self.metrics = MetricsFile(self.out_dir / "metrics.jsonl", start_epoch=start_epoch)
        if writer_cls is not None:
            self.writer = writer_cls(log_dir=str(self.out_dir))

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The rows written so far (rank 0; empty elsewhere)."""
        return [] if self.metrics is None else [dict(r) for r in self.metrics.rows]

    def log(self, row: Mapping[str, Any], *not_a_row: Any, step: int | None = None) -> None:
        """Append `row` (JSON-serialisable values; a one-element tensor or numpy value as its number, as
        Fabric's `log` takes a loss) to metrics.jsonl; TensorBoard gets each numeric value as a scalar
        at `step` (default: the row's "epoch", else the number of rows). Checked on every rank."""
        row = _plain_row(row, not_a_row)
        if self.metrics is None:
            return
        self.metrics.append(row)
        if self.writer is not None:
            at = step if step is not None else int(row.get("epoch", len(self.metrics.rows)))
            for key, value in row.items():
                if isinstance(value, numbers.Real) and not isinstance(value, bool):
                    self.writer.add_scalar(key, float(value), global_step=at)
            self.writer.flush()

    def __getattr__(self, name: str):
        """Fabric's and Lightning loggers' names for `log`, named in one line."""
        if name in ("log_dict", "log_metrics"):
            raise AttributeError(f"'MetricsLogger' object has no attribute {name!r} (Fabric's name): in phalanx, "
                                 "logger.log(row, step=step), row a dict of the step's values")
        raise AttributeError(f"'MetricsLogger' object has no attribute {name!r}")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _plain_row(row: Any, not_a_row: tuple) -> dict[str, Any]:
    """`row` as MetricsFile writes it: a dict whose one-element tensors and numpy values are numbers;
    Fabric's `log(name, value)` and a value JSON cannot write are one TypeError naming the fix."""
    if not_a_row or not isinstance(row, Mapping):
        example = f"{{{row!r}: value}}" if isinstance(row, str) else "{'loss': value}"
        raise TypeError(f"MetricsLogger.log takes one row, a dict: logger.log({example}, step=step) for Fabric's "
                        "fabric.log(name, value, step=step)")
    plain = {}
    for key, value in row.items():
        if hasattr(value, "item") and not isinstance(value, (bool, int, float, str)):
            size = value.numel() if callable(getattr(value, "numel", None)) else getattr(value, "size", 1)
            if size != 1:
                raise TypeError(f"MetricsLogger.log: row[{key!r}] is a {type(value).__name__} of {size} values; "
                                "log numbers (a mean over ranks: phalanx.reduce(value, op='mean', world=world))")
            value = value.item()
        plain[key] = value
    try:
        json.dumps(plain)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"MetricsLogger.log: the row cannot be written as JSON ({exc}); log numbers, strings, "
                        "lists and dicts of them") from None
    return plain


def progress(iterable: Iterable, *, world: Main, label: str = "", total: int | None = None,
             stream: TextIO | None = None) -> Iterator:
    """Yield `iterable`'s items while rank 0 draws the trainer's progress bar (on a terminal
    only; silent in logs and pipes). `total`: the item count when `iterable` has no len()
    (a `ShardedLoader.epoch(e)` generator: pass `len(loader)`)."""
    if total is None:
        total = len(iterable) if hasattr(iterable, "__len__") else 0
    bar = ProgressBar(label=label, enabled=bool(world.is_main), stream=stream)
    try:
        for done, item in enumerate(iterable, start=1):
            yield item
            bar.update(done, max(total, done))
    finally:
        bar.close()
