"""The per-epoch progress bar on stderr: tqdm's, drawn only on a terminal.

tqdm does the drawing (terminal width, rate, time left); this class keeps phalanx's call shape
(`update(done, total)` after each step, `close()` at the epoch's end) and its rules: nothing on a
non-terminal (CI logs, pipes: the per-epoch line carries the information), a redraw at most ~10
times a second, the finished state drawn once, the line erased at close, and no monitor thread
or semaphore.
Measured before the switch (200k updates, median of 5): 0.5 us per step on a terminal for tqdm,
0.3 us for the hand-written bar it replaced; a LeNet step takes milliseconds.
"""

from __future__ import annotations

import shutil
import sys
import threading
from typing import TextIO

from tqdm import tqdm


class _Bar(tqdm):
    monitor_interval = 0  # no watchdog thread in a training process: redraws happen on update only


# tqdm's default lock holds a multiprocessing semaphore, made by every bar (a disabled one too);
# a worker that dies leaks it, and the resource tracker then prints a warning after the run's
# one line. One process draws a bar, so a thread lock is all it needs.
_Bar.set_lock(threading.RLock())


class ProgressBar:
    def __init__(self, *, label: str, enabled: bool, stream: TextIO | None = None) -> None:
        stream = stream or sys.stderr
        # The size as shutil sees it: a terminal reporting 0 x 0 (a bare pty) gets 80 x 24, where
        # tqdm's own probe would draw nothing.
        columns, lines = shutil.get_terminal_size()
        self._bar = _Bar(desc=label, file=stream, disable=not (enabled and stream.isatty()), leave=False,
                         mininterval=0.1, delay=0.1, unit="step", ascii="-#", ncols=columns, nrows=lines,
                         bar_format="{desc} [{bar}] {n_fmt}/{total_fmt} {elapsed}<{remaining}, {rate_fmt}")

    def update(self, done: int, total: int) -> None:
        if self._bar.disable:
            return
        self._bar.total = total
        self._bar.update(done - self._bar.n)
        if done >= total:  # the last step is drawn even within the redraw interval
            self._bar.refresh()

    def close(self) -> None:
        self._bar.close()
