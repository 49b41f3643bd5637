"""Per-epoch metrics as JSON Lines: one flat object per epoch, unit-suffixed keys (`epoch_s`).

The whole file is rewritten atomically after each epoch, so a crash never leaves a torn line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from phalanx.atomic import atomic_write_bytes


class MetricsFile:
    def __init__(self, path: str | os.PathLike, *, start_epoch: int = 0) -> None:
        """`start_epoch` > 0 (a resumed run): keep the file's rows of the epochs up to it, which a
        resumed run continues after; 0 starts the file afresh."""
        self.path = Path(path)
        self.rows: list[dict[str, Any]] = []
        if start_epoch > 0 and self.path.exists():
            self.rows = [r for r in read_metrics(self.path) if r.get("epoch", 0) <= start_epoch]

    def append(self, row: dict[str, Any]) -> None:
        self.rows.append(dict(row))
        text = "".join(json.dumps(r, sort_keys=False) + "\n" for r in self.rows)
        atomic_write_bytes(self.path, text.encode())


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
