"""What /proc says about other processes: a state letter, whether one is still alive or stopped,
who is in a group, how much CPU time one and its reaped children took.

The runtime's one reader of process facts: the supervisor, the collective watchdog (a peer that
died or was stopped while others wait for it), the shared-memory allreduce, the launcher's
clean-up (every process a worker started) and the benches' load accounting ask here.
"""

from __future__ import annotations

import os
from typing import Iterable


def process_state(pid: int) -> str | None:
    """The state letter /proc shows for `pid` (R running, S sleeping, T stopped, Z zombie, ...),
    or None when there is no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


# The state letters of a process that can do nothing until continued: stopped (SIGSTOP, Ctrl-Z) or
# stopped by a tracer (a debugger).
STOPPED = ("T", "t")


def all_stopped(pids: Iterable[int]) -> bool:
    """Whether every one of `pids` sits stopped: it can neither work nor report until continued."""
    return all(process_state(pid) in STOPPED for pid in pids)


def catches_signal(pid: int, signum: int) -> bool:
    """Whether `pid` has a handler installed for `signum` (/proc/PID/status's SigCgt mask); False
    when it has none, is gone, or there is no /proc."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(line.split()[1] for line in f if line.startswith("SigCgt:"))
        return bool(int(mask, 16) >> (signum - 1) & 1)
    except (OSError, StopIteration, IndexError, ValueError):
        return False


def process_cpu_s(pid: int | None) -> float:
    """CPU seconds of `pid` and of its children it reaped (/proc/PID/stat's utime, stime, cutime,
    cstime); 0.0 for None, a process gone meanwhile, or no /proc."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # fields[0] is the state, /proc's field 3
        return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


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
