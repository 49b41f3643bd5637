"""Every rank's last finished step, for a failure line to name: "died (signal SIGKILL) after step 57".

The launcher makes one shared array per worker set (multiprocessing's heap, a file in /dev/shm),
each worker adopts its slot as it starts, and the training step (phalanx train's step hook, the
collective board of a `phalanx run` script) writes the global step it just finished there; the
launcher reads it when a worker fails. Where /dev/shm cannot hold the array (read-only, full) the
failure lines name no step and the run goes on.
"""

from __future__ import annotations

from typing import Any

# Set in a worker of a set: (shared array of every rank's last finished step, this rank).
_PROGRESS: tuple[Any, int] | None = None


def progress_array(ctx, num_procs: int):
    """A fresh array of -1s (no step finished), one per rank, or None where it cannot be made."""
    try:
        return ctx.Array("q", [-1] * num_procs, lock=False)
    except OSError:
        return None


def adopt_slot(progress, rank: int) -> None:
    """In worker `rank`: write its steps into `progress` (None: nowhere)."""
    global _PROGRESS
    _PROGRESS = None if progress is None else (progress, rank)


def report_progress(step: int) -> None:
    """Record the global step this worker just finished, for a failure report to name (a no-op
    outside a worker of a set: one device in-process, torchrun)."""
    if _PROGRESS is not None:
        _PROGRESS[0][_PROGRESS[1]] = step
