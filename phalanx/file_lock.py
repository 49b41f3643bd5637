"""One job per checkpoint: an advisory flock on a lock file beside it, held by the job's rank 0.

Two jobs given one checkpoint location (the same script started twice, a copied command line)
each wrote it in turn, atomically, and a restart of either resumed from the other's state, which
passes every check (the fingerprint is the same): work lost with nothing said. `hold_for_process`
takes an exclusive `fcntl.flock` on `.<name>.lock` beside the checkpoint and keeps it for the rest
of the process; a second process gets a one-line UsageError naming the holder's pid. The kernel
drops a flock when its holder dies (SIGKILL included), so a restarted job takes it again at once
and no stale lock outlives a job. The lock file is removed on a normal exit; one left by a killed
holder is reused. A taker checks, once it holds the lock, that the name still leads to the file it
locked (a holder removing it on the way out could otherwise leave two takers on two files).
Opened without following a link and refused unless a regular file, as job/dirlock.py's pid file.
Advisory: it orders phalanx jobs, not other programs.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import os
import stat
import time
from pathlib import Path
from typing import Callable

from phalanx.errors import UsageError, WriteFailed

# A holder writes its pid right after taking the lock: how long a refused job waits to read it.
PID_WAIT_S = 1.0
_HELD: dict[str, tuple[Path, int]] = {}  # real path of a lock file this process holds -> (path, fd)


def lock_path(target: str | os.PathLike) -> Path:
    """The lock file of `target`: a hidden file beside it."""
    target = Path(target)
    return target.parent / f".{target.name}.lock"


def hold_for_process(target: str | os.PathLike, *, refusal: Callable[[str], str]) -> None:
    """Hold `target`'s lock until this process ends (nothing to do where it holds it already).
    Another process holding it: UsageError(refusal("pid N")). `target`'s directory must exist."""
    path = lock_path(target)
    key = os.path.realpath(path)
    if key in _HELD:
        return
    while True:
        fd = _open(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise UsageError(refusal(holder)) from None
        if _names(path, fd):
            break
        os.close(fd)  # its holder removed it between our open and our flock: take the new one
    with contextlib.suppress(OSError):  # only names the holder to a refused job: a full disk must not stop this one
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    if not _HELD:
        atexit.register(release_all)
    _HELD[key] = (path, fd)


def release_all() -> None:
    """Give back every lock this process holds, removing the lock files that are still its own."""
    for path, fd in list(_HELD.values()):
        with contextlib.suppress(OSError):
            if _names(path, fd):
                os.unlink(path)
        with contextlib.suppress(OSError):
            os.close(fd)  # drops the flock
    _HELD.clear()


def _open(path: Path) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR):
            raise UsageError(f"{path} is not a regular file (a link or a directory); remove it and start again") \
                from None
        raise WriteFailed.of(path, exc) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UsageError(f"{path} is not a regular file; remove it and start again")
    return fd


def _names(path: Path, fd: int) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        named = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _holder(fd: int) -> str:
    return holder_named(lambda: int(os.pread(fd, 32, 0)))


def holder_named(read_pid: Callable[[], int]) -> str:
    """"pid N" from `read_pid()` (OSError or ValueError until the holder has written it), waiting at
    most PID_WAIT_S for it; "pid unknown" after that."""
    deadline = time.monotonic() + PID_WAIT_S
    while True:
        with contextlib.suppress(OSError, ValueError):
            return f"pid {read_pid()}"
        if time.monotonic() > deadline:
            return "pid unknown"
        time.sleep(0.05)
