"""Atomic file writes: a reader (or a crash) sees the old file or the new one, never half of one.

Write to a temporary file in the destination's directory, fsync it, then `os.replace` it over the
target (atomic on POSIX within one filesystem). On any error the temporary file is removed, and an
OS error (a full disk, a quota, a file-size limit, a read-only filesystem) is raised as
`WriteFailed`: one line naming the file, where a bare OSError was a traceback that named only the
temporary file, or nothing. A process stopped by a signal whose handler runs no Python clean-up
(a worker's SIGTERM: runtime.lifeline.flush_on_sigterm) calls `remove_unfinished` first, so a
write cut short by the signal leaves no temporary file behind either. A process killed outright
(SIGKILL, a power cut) cannot; `remove_stale_temporaries` removes what such a write left, for
the next run that holds the directory (job/dirlock.py, under its lock). A temporary file's name
carries its writer's pid, so where no lock covers the directory (a script's `phalanx.resume`:
file_lock.py holds one checkpoint, and another job may write another beside it) it removes,
given `writer_alive`, only those whose writer is gone. `make_dir` creates the directory an API
call names at run time (a script's checkpoint location, a MetricsLogger's), one line where it cannot.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from phalanx.errors import UsageError, WriteFailed

_UNFINISHED: set[str] = set()  # temporary files of this process's writes in progress
# What `atomic_open`'s mkstemp names a temporary file: "." + the target's name + ".p" + the
# writer's pid + "." + 8 random characters + ".tmp" (files of older versions lack the pid).
_TEMPORARY = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$")
_WRITER = re.compile(r"\.p(\d+)\.[a-z0-9_]{8}\.tmp$")


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, *, before_replace: Callable[[], None] | None = None) -> Iterator[BinaryIO]:
    """Yield a binary file whose content replaces `path` only if the block completes.
    `before_replace()` runs once the new content is durable (fsynced), just before the rename."""
    target = Path(path)
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.p{os.getpid()}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise WriteFailed.of(target, exc) from None
    _UNFINISHED.add(tmp_name)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())  # mkstemp makes 0600; a normal file respects the umask
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp_name, target)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        if isinstance(exc, OSError):
            raise WriteFailed.of(target, exc) from None
        raise
    finally:
        _UNFINISHED.discard(tmp_name)


def remove_unfinished() -> None:
    """Remove the temporary file of every write this process has in progress (safe inside a
    signal handler that is about to end the process: unlink only, errors ignored)."""
    for tmp_name in list(_UNFINISHED):
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)


def remove_stale_temporaries(directory: str | os.PathLike, *,
                             writer_alive: Callable[[int], bool] | None = None) -> list[Path]:
    """Remove the temporary files that interrupted atomic writes left in `directory` (named as
    `atomic_open` names them); return them. Without `writer_alive`, every one: only for a caller
    that knows no write is in progress there (it holds the directory's lock). With it, only those
    whose name carries a writer's pid that `writer_alive(pid)` says is gone: safe without a lock
    where every writer is a process of this host."""
    removed = []
    with contextlib.suppress(OSError):  # a directory that cannot be listed has nothing to sweep
        for entry in os.scandir(directory):
            if not (_TEMPORARY.match(entry.name) and entry.is_file(follow_symlinks=False)):
                continue
            writer = _WRITER.search(entry.name)
            if writer_alive is not None and (writer is None or writer_alive(int(writer[1]))):
                continue
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


def current_umask() -> int:
    """This process's umask (reading it means setting it: set back at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *,
                       before_replace: Callable[[], None] | None = None) -> None:
    with atomic_open(path, before_replace=before_replace) as handle:
        handle.write(data)


def sync_directory(directory: str | os.PathLike) -> None:
    """fsync `directory`, so the renames made in it survive a power cut (best effort: a
    filesystem that cannot fsync a directory keeps whatever order it keeps)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def make_dir(directory: str | os.PathLike, *, named: str) -> None:
    """`mkdir -p directory` for an output a call names at run time, where no flag was checked before
    the run (outdir.py checks those): a path that cannot be made is one UsageError naming `named`,
    the directory and why (a file on the way, permission), not FileExistsError's traceback."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        blocker = next((p for p in (directory, *directory.parents) if p.exists() and not p.is_dir()), None)
        reason = f"{blocker} is a file" if blocker is not None else exc.strerror or type(exc).__name__
        raise UsageError(f"{named} {directory} cannot be created ({reason}); pick another directory") from None
