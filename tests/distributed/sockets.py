"""The TCP addresses a process listens on, read from Linux /proc: for the tests that a run's
rendezvous store and gloo's pairs listen on loopback only."""

from __future__ import annotations

import os
from pathlib import Path


def listening_addresses(pid: int | str = "self") -> list[str]:
    """Local addresses of the TCP sockets process `pid` listens on, in /proc's hex (0100007F is
    127.0.0.1); a socket is the process's when one of its file descriptors points at its inode."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:] if Path(table).exists() else []:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(fields[1].split(":")[0])
    return found
