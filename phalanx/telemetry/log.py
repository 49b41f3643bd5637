"""One logger for a run: only the main rank prints, always flushed (workers share one terminal).

A run's stdout or stderr may fail under it: its reader closes (`phalanx train | head`, a `tee`
or log shipper that dies: BrokenPipeError), or the file it is redirected to cannot grow
(`phalanx train > /full/fs/log`: ENOSPC, found by an outside trial where the run died at epoch
47 of 80 with no checkpoint). Python raises OSError at the next print and the run died there,
losing the steps since its last checkpoint. `survive_lost_output()` makes the first such error
point that file descriptor at /dev/null (so every later write, Python's or C's, goes nowhere),
says so once on stderr when stdout is the one lost (a lost stderr can tell no one) and lets
training go on: its rows are in metrics.jsonl all the same. `phalanx run`'s launcher asks for
`redirect=False`: the descriptors stay as they are, so a worker it starts later (a restart)
inherits the lost output itself and the script's own prints fail there as under python.
"""

from __future__ import annotations

import contextlib
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


class _SurvivingStream:
    """sys.stdout or sys.stderr, but a failed write ends its output instead of the run (see above)."""

    def __init__(self, stream: TextIO, name: str, *, redirect: bool = True) -> None:
        self._stream, self._name, self._gone, self._redirect = stream, name, False, redirect

    def _lost(self, exc: OSError) -> None:
        if self._gone:
            return
        self._gone = True
        if self._redirect:  # else each later write fails again, and is swallowed again
            with contextlib.suppress(OSError, ValueError):  # no descriptor left to open: the writes stay swallowed
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, self._stream.fileno())
                os.close(devnull)
        if self._name == "stdout":
            why = ("was closed by its reader" if isinstance(exc, BrokenPipeError)
                   else f"cannot be written ({exc.strerror or exc})")
            with contextlib.suppress(OSError, ValueError):  # stderr lost as well: nobody to tell
                print(f"phalanx: stdout {why} (pid {os.getpid()}); training goes on, its lines are lost "
                      "(metrics.jsonl keeps every epoch's row)", file=sys.stderr, flush=True)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            self._lost(exc)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            self._lost(exc)
            with contextlib.suppress(OSError):
                self._stream.flush()  # what was buffered goes to /dev/null now

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def survive_lost_output(*, redirect: bool = True) -> None:
    """From now on in this process a failed stdout or stderr ends its output, not the run (once;
    see above). `redirect`: point the lost descriptor at /dev/null (False: leave it as it is)."""
    for name in ("stderr", "stdout"):  # stderr first: it carries the line saying stdout is lost
        stream = getattr(sys, name)
        if isinstance(stream, _SurvivingStream) or stream is None:
            continue
        try:
            stream.fileno()
        except (OSError, ValueError, AttributeError):  # no file descriptor (captured): nothing can fail it
            continue
        setattr(sys, name, _SurvivingStream(stream, name, redirect=redirect))
