"""Restarting a whole worker set after a worker fails, as `torchrun --max-restarts N` does.

`failure_of` reads a launch's `WorkerFailed` for what a restart can get past (a worker that
died, raised or stopped answering: its rank, its device, how) - or None for what would repeat (a
checked condition such as a NaN loss, bad input, a failure no rank is blamed for).
`with_restarts` starts the workers again, every one, after such a failure, up to N times, each
restart one line on stderr naming the rank, its device and what happened (then the rank's
traceback, where it raised: a restart must not hide why it was needed); the attempt's number
reaches the workers as torchrun's `TORCHELASTIC_RESTART_COUNT`. A script resumes by itself
(`phalanx.resume(...)` from its last `phalanx.checkpoint(...)`); `phalanx train`'s restarts
(job/elastic.py) also give up a device that keeps failing, reading failures here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from phalanx.runtime.worker_errors import WorkerFailed


@dataclass(frozen=True, kw_only=True)
class Failure:
    rank: int
    device: str
    what: str  # "died (signal SIGKILL) after step 31"
    traceback: str = ""  # the rank's own report, "" for a death

    def shown(self) -> str:
        """What follows a restart line: the failed rank's traceback, as the run's end shows it."""
        return f"\n--- rank {self.rank} ---\n{self.traceback}" if self.traceback else ""


def failure_of(exc: WorkerFailed, names: Sequence[str]) -> Failure | None:
    """The rank and device a launch failure blames when a restart can get past it (a worker that
    died, raised or stopped responding: `exc.rank`, `exc.restartable`), else None (a checked
    condition that would repeat, such as a NaN loss, or no rank to blame)."""
    if not exc.restartable or exc.rank is None or not 0 <= exc.rank < len(names):
        return None
    first = str(exc).splitlines()[0] if str(exc) else ""
    for prefix in (f"worker rank {exc.rank} failed: ", f"run stopped: worker rank {exc.rank} "):
        first = first.removeprefix(prefix)
    # script_errors.loader_worker_lost's line, "run stopped: rank 1's DataLoader worker (pid 5) exited ...".
    first = re.sub(rf"^run stopped: rank {exc.rank}'s (DataLoader worker \(pid [\d, ]+\)) ", r"lost its \1, which ",
                   first)
    return Failure(rank=exc.rank, device=names[exc.rank], what=first.strip(), traceback=exc.traceback)


def with_restarts(start: Callable[[int], Any], *, max_restarts: int, names: Sequence[str],
                  say: Callable[[str], None]) -> Any:
    """`start(restart_count)`, started again after each failure `failure_of` can get past, up to
    `max_restarts` times; what the attempt that finished returned. The last failure, or one a
    restart would repeat, is raised as it came."""
    restarts = 0
    while True:
        try:
            return start(restarts)
        except WorkerFailed as exc:
            failure = failure_of(exc, names)
            if failure is None or restarts >= max_restarts:
                raise
            restarts += 1
            say(f"worker rank {failure.rank} ({failure.device}) {failure.what}; restart {restarts} of {max_restarts}: "
                f"every worker starts again (TORCHELASTIC_RESTART_COUNT={restarts}){failure.shown()}")
