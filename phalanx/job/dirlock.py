"""One run per output directory: an advisory lock on --out, the checkpoint dir and --trace, held by the launcher.

`hold_run_directories` takes an `fcntl.flock` on each directory the run writes (creating it if
missing) before any worker starts, and holds it until the launcher is done, however it ends: the
kernel drops a flock when its holder's file is closed or the holder dies (SIGKILL included), so
no stale lock outlives a run, and spawned workers do not inherit it. The lock is on the directory
itself, so no lock file can be deleted or swapped under it; a small pid file beside it
(`.phalanx-run.pid`, removed on the way out) only lets a second run name the holder: it stops in
one line, exit 2. The pid file is made afresh (O_EXCL) and read without following a link or
waiting on a FIFO: in a directory another user can write, a link left there to one of this
user's files had the pid written through it (the file clobbered), and a FIFO hung the run. Holding the locks, it refuses an --out or checkpoint dir that holds an earlier
run's outputs unless this run continues them (--resume, or a torchrun restart) or replaces them
(--overwrite deletes them). Directories it created and that stay empty are removed on the way
out, so a refused run leaves nothing. Holding a directory, it removes the temporary files of
atomic writes that a run killed outright left there (atomic.remove_stale_temporaries): under the
lock no other phalanx run can be writing them. Advisory: it orders phalanx runs, not other programs.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from pathlib import Path
from typing import Iterator

from phalanx.atomic import remove_stale_temporaries
from phalanx.errors import UsageError
from phalanx.file_lock import holder_named
from phalanx.outdir import check_out_dir
from phalanx.telemetry.metrics import read_metrics
from phalanx.train.checkpoint import FILENAME as CHECKPOINT_FILENAME, generation_paths
from phalanx.train.sharded_checkpoint import share_files
from phalanx.train.checkpoint_files import damaged_of, previous_of
from phalanx.job.config import TrainConfig
from phalanx.job.outputs import Outputs
from phalanx.job.resume import requested_resume

PID_FILE = ".phalanx-run.pid"


@contextlib.contextmanager
def hold_run_directories(config: TrainConfig, *, enabled: bool = True) -> Iterator[None]:
    """Lock --out and (when the run checkpoints) the checkpoint dir for the block; refuse a held
    one, or one holding an earlier run's outputs, in one line. `enabled=False`: hold nothing (a
    torchrun rank other than 0, which writes nothing)."""
    held: list[_Lock] = []
    try:
        if enabled:
            for flag, directory in _directories(config):
                held.append(_Lock.take(flag, Path(directory)))
            _check_earlier_outputs(config)
        yield
    finally:
        for lock in reversed(held):
            lock.release()


def _directories(config: TrainConfig) -> list[tuple[str, str]]:
    found = [("--out", config.out_dir)] if config.out_dir else []
    if config.checkpoint.every is not None and config.checkpoint_location:
        flag = "--checkpoint-dir" if config.checkpoint.directory is not None else "the checkpoint dir"
        found.append((flag, config.checkpoint_location))
    if config.trace_dir:  # two runs' traces in one directory overwrote each other, silently
        found.append(("--trace", config.trace_dir))
    unique, seen = [], set()
    for flag, directory in found:  # one lock per directory: a second flock on it would block this process
        key = os.path.realpath(directory)
        if key not in seen:
            seen.add(key)
            unique.append((flag, directory))
    return unique


def _earlier_outputs(config: TrainConfig) -> list[Path]:
    found = list(Outputs(out_dir=Path(config.out_dir)).files) if config.out_dir else []
    # The checkpoints this run would write, or those under --out a later --resume auto would find.
    if config.checkpoint_location and (config.checkpoint.every is not None or config.checkpoint.directory is None):
        found.extend(generation_paths(Path(config.checkpoint_location) / CHECKPOINT_FILENAME))
        found.append(damaged_of(Path(config.checkpoint_location) / CHECKPOINT_FILENAME))  # set aside by a resume
        found.extend(share_files(Path(config.checkpoint_location)))  # a sharded checkpoint's: go with it
    return [path for path in found if path.is_file()]


def _check_earlier_outputs(config: TrainConfig) -> None:
    earlier = _earlier_outputs(config)
    resume = requested_resume(config)
    if not earlier:
        return  # nothing to lose
    shares = set(share_files(Path(config.checkpoint_location))) if config.checkpoint_location else set()
    generations = set(generation_paths(Path(config.checkpoint_location) / CHECKPOINT_FILENAME)) \
        if config.checkpoint_location else set()
    can_continue = any(path in generations or path in shares for path in earlier)
    if resume is not None and (can_continue or config.checkpoint.resume != "auto"):
        # This run continues them (a torchrun restart before its first checkpoint starts over); a
        # damaged metrics file is one line now, not in rank 0 once the workers are up.
        metrics = Outputs(out_dir=Path(config.out_dir)).metrics if config.out_dir else None
        if metrics is not None and metrics.is_file():
            read_metrics(metrics)
        return
    if config.overwrite:
        for path in earlier:  # a fresh run's outputs must not mix with the old ones
            path.unlink(missing_ok=True)
        return
    where = config.out_dir if config.out_dir else config.checkpoint_location
    flag = "--out" if config.out_dir else "--checkpoint-dir"
    named = [p for p in earlier if p not in shares  # one per checkpoint
             and not any(p in (previous_of(q), damaged_of(q)) for q in earlier)]
    names = ", ".join(str(p.relative_to(where)) if p.is_relative_to(where) else str(p) for p in named)
    if can_continue:
        raise UsageError(f"{flag} {where} holds an earlier run's outputs ({names}); continue that run with "
                         "--resume auto, or replace them with --overwrite")
    # No checkpoint to continue from: --resume auto would start over and replace them.
    found = "--resume auto found no checkpoint in it to continue from" if resume else "it saved no checkpoint"
    raise UsageError(f"{flag} {where} holds an earlier run's outputs ({names}) and {found} (a run checkpoints "
                     "with --checkpoint-every); replace them with --overwrite, or pick another directory")


class _Lock:
    """An exclusive flock on one directory, with the directories made to hold it."""

    def __init__(self, path: Path, fd: int, created: list[Path]) -> None:
        self.path, self.fd, self.created = path, fd, created

    @classmethod
    def take(cls, flag: str, path: Path) -> "_Lock":
        check_out_dir(path, flag=flag)  # the default checkpoint dir too: a dangling link there is one line
        created = _make_dirs(path)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)  # close-on-exec: workers never hold it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            _remove_empty(created)
            raise UsageError(f"{flag} {path} is in use by another phalanx run ({_holder(path)}); wait for it "
                             "to end or pick another directory") from None
        with contextlib.suppress(OSError):  # only informational: a full disk must not stop the run here
            _write_pid(path)
        remove_stale_temporaries(path)
        return cls(path, fd, created)

    def release(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            if _read_pid(self.path) == os.getpid():
                (self.path / PID_FILE).unlink()
        os.close(self.fd)  # drops the flock
        _remove_empty(self.created)


def _make_dirs(path: Path) -> list[Path]:
    """Create `path` and its missing parents; return the ones created, outermost first."""
    missing = [p for p in (path, *path.parents) if not p.exists()][::-1]
    path.mkdir(parents=True, exist_ok=True)  # another run may create it at the same moment: fine
    return missing


def _remove_empty(created: list[Path]) -> None:
    for directory in reversed(created):  # innermost first
        with contextlib.suppress(OSError):
            directory.rmdir()  # only if still empty


def _holder(path: Path) -> str:
    return holder_named(lambda: _read_pid(path))


def _write_pid(path: Path) -> None:
    """This process's pid in `path`'s PID_FILE, a new file: whatever holds the name (a killed run's
    file, or a link or FIFO someone left) is removed first, never written through."""
    pid_file = path / PID_FILE
    with contextlib.suppress(FileNotFoundError):
        os.unlink(pid_file)
    fd = os.open(pid_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as handle:
        handle.write(f"{os.getpid()}\n")


def _read_pid(path: Path) -> int:
    """The pid in `path`'s PID_FILE; OSError or ValueError where there is none (a link, a FIFO or
    anything but a regular file counts as none, read without waiting)."""
    fd = os.open(path / PID_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{PID_FILE} is not a regular file")
        return int(handle.read(32))
