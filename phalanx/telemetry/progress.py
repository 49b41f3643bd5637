"""A dependency-free per-epoch progress bar on stderr, drawn only on a terminal.

Redrawn at most ~10 times a second so a fast loop does not spend its time printing; on a
non-terminal (CI logs, pipes) it stays silent and the per-epoch line carries the information.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    def __init__(self, *, label: str, enabled: bool, stream: TextIO | None = None, width: int = 30) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled and self.stream.isatty()
        self.label = label
        self.width = width
        self._last_draw_s = 0.0
        self._start_s = time.perf_counter()

    def update(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if done < total and now - self._last_draw_s < 0.1:
            return
        self._last_draw_s = now
        filled = self.width * done // max(total, 1)
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed_s = now - self._start_s
        self.stream.write(f"\r{self.label} [{bar}] {done}/{total} {elapsed_s:5.1f}s")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * (len(self.label) + self.width + 30) + "\r")
            self.stream.flush()
