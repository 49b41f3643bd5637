"""Per-epoch metrics as JSON Lines: one flat object per epoch, unit-suffixed keys (`epoch_s`).

The whole file is rewritten atomically after each epoch, so a crash never leaves a torn line: a
line that is not a JSON object was damaged by something else (a copy cut short, a `truncate`, an
editor), and reading it is refused in one line naming the file and the line (`read_metrics`),
before a resumed run would rewrite the file from what it could read. A resumed run keeps the
rows of the epochs before its checkpoint's and notes those missing (`MetricsFile.missing_epochs`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from phalanx.atomic import atomic_write_bytes
from phalanx.errors import UsageError


class MetricsFile:
    def __init__(self, path: str | os.PathLike, *, start_epoch: int = 0) -> None:
        """`start_epoch` > 0 (a resumed run): keep the file's rows of the epochs up to it, which a
        resumed run continues after; 0 starts the file afresh. `missing_epochs`: the epochs up to
        `start_epoch` (1-based, as the rows count) the file has no row for (deleted rows, or a
        deleted file)."""
        self.path = Path(path)
        self.rows: list[dict[str, Any]] = []
        if start_epoch > 0 and self.path.exists():
            self.rows = [r for r in read_metrics(self.path) if r.get("epoch", 0) <= start_epoch]
        kept = {r.get("epoch") for r in self.rows}
        self.missing_epochs = [epoch for epoch in range(1, start_epoch + 1) if epoch not in kept]

    def append(self, row: dict[str, Any]) -> None:
        self.rows.append(dict(row))
        text = "".join(json.dumps(r, sort_keys=False) + "\n" for r in self.rows)
        atomic_write_bytes(self.path, text.encode())


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a metrics file; a line that is not a JSON object is `UsageError` (see above)."""
    rows = []
    for number, line in enumerate(Path(path).read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:  # json's decode errors and a line that is not UTF-8
            row = None
        if not isinstance(row, dict):
            raise UsageError(f"{path} is damaged: line {number} is not a whole JSON row (phalanx writes the file "
                             "whole, so something else cut or changed it); restore it from a copy, or delete it "
                             "to resume without its rows (the checkpoint holds the training)")
        rows.append(row)
    return rows
