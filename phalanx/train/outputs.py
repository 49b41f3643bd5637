"""What a training job leaves under `--out`: metrics.jsonl, accuracy.png and model.pt (rank 0 writes).

metrics.jsonl gets a row after every epoch (a resumed run keeps the finished epochs' rows and
continues after them); at the end accuracy.png plots the curves and model.pt holds the whole
model's `state_dict` on the CPU, loadable with weights_only=True, whichever way the work was
split. Every write is atomic, and all of them happen before teardown so an exit-time abort
cannot lose them. Nothing is created before training actually starts.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from phalanx.atomic import atomic_write_bytes
from phalanx.telemetry import MetricsFile, plot_accuracy
from phalanx.telemetry.metrics import read_metrics


def save_state_dict(path: Path, module: torch.nn.Module) -> None:
    """`module`'s state dict, moved to the CPU, written atomically to `path`."""
    buffer = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in module.state_dict().items()}, buffer)
    atomic_write_bytes(path, buffer.getvalue())


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

    def open_metrics(self, *, start_epoch: int) -> tuple[MetricsFile, list[dict[str, Any]]]:
        """Create --out; (the metrics file, the rows of the epochs already done before `start_epoch`)."""
        os.makedirs(self.out_dir, exist_ok=True)
        metrics = MetricsFile(self.metrics)
        if start_epoch > 0 and self.metrics.exists():  # keep the finished epochs' rows only
            metrics.rows = [r for r in read_metrics(self.metrics) if r.get("epoch", 0) <= start_epoch]
        return metrics, [dict(r) for r in metrics.rows]

    def finish(self, history: list[dict[str, Any]], whole_model: torch.nn.Module, *, title: str) -> None:
        """accuracy.png from the rows, model.pt from the whole model."""
        plot_accuracy(self.accuracy_png, epochs=[r["epoch"] for r in history],
                      test_acc=[r["test_acc"] for r in history], train_acc=[r["train_acc"] for r in history],
                      title=title)
        save_state_dict(self.model, whole_model)
