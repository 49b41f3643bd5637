"""What a training job leaves under `--out`: metrics.jsonl, accuracy.png and model.pt (rank 0 writes).

metrics.jsonl gets a row after every epoch (a resumed run keeps the finished epochs' rows and
continues after them, warning of any it lacks); at the end accuracy.png plots the curves and model.pt holds the whole
model's `state_dict` on the CPU, loadable with weights_only=True, whichever way the work was
split. Every write is atomic, and all of them happen before teardown so an exit-time abort
cannot lose them. Nothing is written before training actually starts (the launcher may create
--out empty, to lock it: dirlock.py). When model.pt cannot be written (a full disk), the
trained weights are not lost silently: the run stops in one line naming where they are - the
last checkpoint, which holds exactly the final model, or else a copy in the temporary directory.
"""

from __future__ import annotations

import io
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from phalanx.atomic import atomic_write_bytes
from phalanx.errors import FREE_SPACE, RunFailed, write_fix
from phalanx.telemetry import MetricsFile, plot_accuracy


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

    @property
    def files(self) -> tuple[Path, ...]:
        """Every file a run writes under --out (what an earlier run leaves behind)."""
        return self.metrics, self.accuracy_png, self.model

    def open_metrics(self, *, start_epoch: int, warn: Callable[[str], None]) -> tuple[MetricsFile, list[dict[str, Any]]]:
        """Create --out; (the metrics file, the rows of the epochs already done before `start_epoch`).
        Rows missing for some of those epochs (a deleted file or rows) are one line to `warn`: the
        run resumes, since the checkpoint holds the training and refusing would leave only
        --overwrite, which deletes it; the line says what the file and the plot will lack."""
        os.makedirs(self.out_dir, exist_ok=True)
        metrics = MetricsFile(self.metrics, start_epoch=start_epoch)  # the finished epochs' rows only
        missing = metrics.missing_epochs
        if missing:
            span = f"epoch {missing[0]}" if len(missing) == 1 else f"{len(missing)} epochs ({_epochs_text(missing)})"
            plot = (f"accuracy.png starts at epoch {len(missing) + 1}" if missing == list(range(1, len(missing) + 1))
                    else "accuracy.png skips them")
            warn(f"phalanx: warning: {self.metrics} has no row for {span} of the {start_epoch} the checkpoint "
                 f"has trained (deleted?); training resumes from the checkpoint, those rows stay missing and {plot}")
        return metrics, [dict(r) for r in metrics.rows]

    def finish(self, history: list[dict[str, Any]], whole_model: torch.nn.Module | None, *, title: str,
               checkpoint: Path | None = None, write_model: Callable[[Path], None] | None = None) -> None:
        """model.pt from the whole model, then accuracy.png from the rows. `checkpoint`: the last
        epoch's checkpoint (None: the run kept none), named if model.pt cannot be written.
        `write_model(path)` writes model.pt instead where no rank holds the whole model
        (`whole_model` None: shard="parameters" streams it, bucket by bucket, once)."""
        try:
            if write_model is not None:
                write_model(self.model)
            else:
                save_state_dict(self.model, whole_model)
        except OSError as exc:
            raise RunFailed(self._model_not_written(exc, whole_model, checkpoint)) from None
        try:
            plot_accuracy(self.accuracy_png, epochs=[r["epoch"] for r in history],
                          test_acc=[r["test_acc"] for r in history], train_acc=[r["train_acc"] for r in history],
                          title=title)
        except OSError as exc:
            raise RunFailed(f"cannot write {self.accuracy_png} ({_reason(exc)}); {self.model} and "
                            f"{self.metrics.name} are written") from None

    def _model_not_written(self, exc: OSError, whole_model: torch.nn.Module, checkpoint: Path | None) -> str:
        """The one line saying where the trained weights are, keeping a copy when no checkpoint holds them."""
        failed = f"cannot write {self.model} ({_reason(exc)})"
        if checkpoint is not None and checkpoint.is_file() and whole_model is None:
            return (f"{failed}; the trained model is in the last checkpoint, {checkpoint} and the shares it names "
                    "(resume from it with --epochs unchanged to write model.pt again)")
        if checkpoint is not None and checkpoint.is_file():
            return (f"{failed}; the trained model is in the last checkpoint, {checkpoint} (its 'model' entry is "
                    "the state dict model.pt would hold)")
        if whole_model is None:
            return (f"{failed}; the model is sharded over the ranks and was streamed to it once, so the trained "
                    "weights are lost: keep checkpoints (--checkpoint-every epoch) to have them on disk")
        spare = Path(tempfile.gettempdir()) / f"phalanx-model-{os.getpid()}.pt"
        try:
            save_state_dict(spare, whole_model)
        except OSError as again:  # the fix model.pt's reason calls for (--out is where the run writes)
            return f"{failed} nor a copy at {spare} ({_reason(again)}); the trained weights are lost: {write_fix(exc)}"
        if write_fix(exc) != FREE_SPACE:  # not a want of space: what its reason calls for
            return f"{failed}; the trained model is kept at {spare} instead; {write_fix(exc)}"
        return f"{failed}; the trained model is kept at {spare} instead: move it to {self.model} once there is space"


def _reason(exc: OSError) -> str:
    if exc.strerror:
        return exc.strerror
    return str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__


def _epochs_text(epochs: list[int]) -> str:
    """"1-3, 5": the epochs as runs of consecutive numbers."""
    spans, start = [], epochs[0]
    for prev, cur in zip(epochs, epochs[1:] + [None]):
        if cur != prev + 1:
            spans.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(spans)
