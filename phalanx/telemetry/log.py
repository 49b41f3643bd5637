"""One logger for a run: only the main rank prints, always flushed (workers share one terminal)."""

from __future__ import annotations

import sys
from typing import TextIO


class RankZeroLog:
    def __init__(self, *, enabled: bool, stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.stream = stream

    def __call__(self, message: str) -> None:
        if self.enabled:
            stream = self.stream or sys.stdout
            print(message, file=stream, flush=True)
