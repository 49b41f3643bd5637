"""What /proc says about another process: its state letter, and whether it is still alive.

The runtime's one reader of process facts: the supervisor, the collective watchdog (a peer that
died or was stopped while others wait for it) and the shared-memory allreduce ask here.
"""

from __future__ import annotations

import os


def process_state(pid: int) -> str | None:
    """The state letter /proc shows for `pid` (R running, S sleeping, T stopped, Z zombie, ...),
    or None when there is no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def process_alive(pid: int) -> bool:
    """False when `pid` is gone or a zombie (dead, not yet reaped by its parent)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
