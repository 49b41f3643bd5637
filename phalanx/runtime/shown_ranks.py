"""Which workers' output reaches the console: `phalanx run --local-ranks-filter 0`, torchrun's flag.

Eight workers that each print the same loss line or progress bar fill a console eightfold (tqdm's
bars overwrite each other). torchrun's `--local-ranks-filter 0,1` shows the listed local ranks'
stdout and stderr and sends the others' to /dev/null; `phalanx run` takes the flag and does the
same, each worker pointing its own descriptors 1 and 2 at /dev/null before the script runs (its
children, DataLoader workers, inherit them). Only what a worker prints goes: a failing rank's error
reaches the launcher through its report whatever the filter, so the failure line and traceback
still name it, and the launcher's own lines stay. Unlike torchrun, a rank no worker has is refused
in one line (torchrun shows nothing and says nothing); torchtitan's scripts pass the flag
(`--local-ranks-filter ${LOG_RANK}`).
"""

from __future__ import annotations

import contextlib
import os
import sys

from phalanx.errors import UsageError

FLAG = "--local-ranks-filter"


def check_shown(ranks: tuple[int, ...] | None, *, local_workers: int) -> None:
    """Refuse a filter that names a local rank no worker of this host has (it would show nothing)."""
    missing = sorted({rank for rank in ranks or () if rank >= local_workers})
    if missing:
        listed = ", ".join(map(str, missing))
        raise UsageError(f"{FLAG} names local rank{'s' * (len(missing) > 1)} {listed}, but this host runs "
                         f"{local_workers} worker{'s' * (local_workers > 1)} (local ranks 0 to {local_workers - 1}); "
                         f"name ranks below {local_workers}, e.g. {FLAG} 0")


def mute_unless_shown(local_rank: int, ranks: tuple[int, ...] | None) -> None:
    """In a worker: stdout and stderr to /dev/null unless `ranks` is None (no filter: every rank
    shown) or lists `local_rank`. Python's streams are flushed first: nothing printed before is lost."""
    if ranks is None or local_rank in ranks:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a stream the script replaced or closed
            stream.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for descriptor in (1, 2):
            os.dup2(devnull, descriptor)
    finally:
        os.close(devnull)
