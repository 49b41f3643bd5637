"""One logger for a run: only the main rank prints, always flushed (workers share one terminal).

A run's stdout may close under it (`phalanx train | head`, a `tee` or log shipper that dies, a
closed terminal): Python then raises BrokenPipeError at the next print, and the run died there,
losing the steps since its last checkpoint. `survive_closed_stdout()` makes the first such error
point file descriptor 1 at /dev/null (so every later write, Python's or C's, goes nowhere),
says so once on stderr, and lets training go on: its rows are in metrics.jsonl all the same.
"""

from __future__ import annotations

import os
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


class _SurvivingStdout:
    """sys.stdout, but a closed reader ends its output instead of the run (see the module docstring)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream, self._gone = stream, False

    def _closed(self) -> None:
        if not self._gone:
            self._gone = True
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
            print(f"phalanx: stdout was closed by its reader (pid {os.getpid()}); training goes on, its lines are "
                  "lost (metrics.jsonl keeps every epoch's row)", file=sys.stderr, flush=True)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._closed()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._closed()
            self._stream.flush()  # what was buffered goes to /dev/null now

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def survive_closed_stdout() -> None:
    """From now on in this process a closed stdout ends its output, not the run (once; see above)."""
    if not isinstance(sys.stdout, _SurvivingStdout) and sys.stdout is not None:
        try:
            sys.stdout.fileno()
        except (OSError, ValueError, AttributeError):  # no file descriptor (captured): nothing can close it
            return
        sys.stdout = _SurvivingStdout(sys.stdout)
