"""What /proc says about other processes: a state letter, whether one is still alive, who is in a group.

The runtime's one reader of process facts: the supervisor, the collective watchdog (a peer that
died or was stopped while others wait for it), the shared-memory allreduce and the launcher's
clean-up (every process a worker started) ask here.
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


def group_members(pgids) -> dict[int, list[int]]:
    """The live (not zombie) processes of each process group in `pgids`: {pgid: [pid, ...]}, a
    group with none left absent. One pass over /proc; empty where there is no /proc."""
    wanted, members = {int(p) for p in pgids}, {}
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # state, ppid, pgrp, session, ...
        except (OSError, IndexError):
            continue  # gone meanwhile
        if len(fields) > 2 and int(fields[2]) in wanted and fields[0] not in (b"Z", b"X"):
            members.setdefault(int(fields[2]), []).append(pid)
    return members
