"""Each worker's output in files of its own: `phalanx run --log-dir DIR --tee 3`, torchrun's three flags.

Eight workers that print interleave eight streams on one console. torchrun keeps each worker's
stdout and stderr in files under `--log-dir` for the streams that `--redirects` (files only) and
`--tee` (files and console) name - 0 none, 1 stdout, 2 stderr, 3 both - for every local rank, or
rank by rank (`0:3,1:2`). phalanx run takes the same flags and writes
DIR/attempt_<n>/<local rank>/stdout.log and stderr.log (n: the restart, TORCHELASTIC_RESTART_COUNT;
torchrun puts a run id above the attempts). `--log-dir` alone tees both streams: torchrun then
writes no output file, and asking for the directory is asking for the logs. The files are
appended to, never truncated.

Each worker points its descriptors 1 and 2 at its files before the script runs (its children,
DataLoader workers, inherit them). The console copy of a tee'd stream is the launcher's: it reads
the files as they grow (every 0.1 s, and once more when the workers are done) and prints each line
after a `[rank N]: ` prefix, as torchrun's agent prints `[default0]:`, so what a worker wrote
before it was killed outright still reaches the console. `--local-ranks-filter` applies to the
console only, as torchrun's does: a rank not shown still writes its files. Under torchrun these
flags are torchrun's to take.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from phalanx.errors import UsageError
from phalanx.options import check_options, option

T = TypeVar("T")
STREAMS = {1: "stdout", 2: "stderr"}
POLL_S = 0.1


def parse_streams(text: str, *, flag: str) -> dict[int, int] | int:
    """torchrun's form: one digit 0-3 for every local rank, or `rank:digit,...` per rank."""
    def digit(value: str) -> int:
        if value.strip() not in ("0", "1", "2", "3"):
            raise ValueError(f"{flag} {text} is not 0 (neither stream), 1 (stdout), 2 (stderr) or 3 (both), for "
                             f"every local rank or rank by rank (0:3,1:2); e.g. {flag} 3")
        return int(value)

    if ":" not in text:
        return digit(text)
    streams = {}
    for item in text.split(","):
        rank, _, value = item.partition(":")
        if not rank.strip().isdigit():
            raise ValueError(f"{flag} {text}: {item!r} is not rank:streams; e.g. {flag} 0:3,1:2")
        streams[int(rank)] = digit(value)
    return streams


@dataclass(frozen=True, kw_only=True)
class WorkerLogs:
    """worker logs: each worker's stdout and stderr in files, as torchrun's --log-dir, --redirects and --tee"""

    log_dir: str | None = option(None, flag="--log-dir", metavar="DIR", default_text="none",
                                 help="write each worker's stdout and stderr to DIR/attempt_N/RANK/stdout.log and "
                                      "stderr.log (alone: both streams, to the files and the console)")
    redirects: str | None = option(None, metavar="0-3|R:0-3,...", default_text="0",
                                   help="the streams (1 stdout, 2 stderr, 3 both) that go to the files only")
    tee: str | None = option(None, metavar="0-3|R:0-3,...", default_text="3 with --log-dir",
                             help="the streams that go to the files and to the console")

    def __post_init__(self) -> None:
        check_options(self)
        if self.log_dir is not None and Path(self.log_dir).exists() and not Path(self.log_dir).is_dir():
            raise ValueError(f"--log-dir {self.log_dir} is a file, not a directory; give a directory (made if missing)")
        for flag, value in (("--redirects", self.redirects), ("--tee", self.tee)):
            if value is not None:
                parse_streams(value, flag=flag)
                if self.log_dir is None:
                    raise ValueError(f"{flag} {value} writes each worker's streams to files: add --log-dir DIR")

    def streams(self, local_rank: int) -> tuple[int, int]:
        """(redirected, tee'd) streams of `local_rank`, each 0-3; a stream in both is redirected."""
        if self.log_dir is None:
            return 0, 0
        given = [parse_streams(v, flag="") if v is not None else None for v in (self.redirects, self.tee)]
        redirected, teed = (g.get(local_rank, 0) if isinstance(g, dict) else (g or 0) for g in given)
        if self.redirects is None and self.tee is None:
            teed = 3
        return redirected, teed & ~redirected

    def path(self, attempt: int, local_rank: int, stream: int) -> Path:
        return Path(self.log_dir) / f"attempt_{attempt}" / str(local_rank) / f"{STREAMS[stream]}.log"


def write_to_files(logs: WorkerLogs | None, local_rank: int) -> None:
    """In a worker: descriptors 1 and 2 to this rank's files where redirected or tee'd (after
    --local-ranks-filter, which sent a rank not shown to /dev/null); nothing without --log-dir."""
    if logs is None or logs.log_dir is None:
        return
    redirected, teed = logs.streams(local_rank)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for stream in STREAMS:
        if (redirected | teed) & stream:
            with contextlib.suppress(Exception):  # a stream the script replaced or closed
                (sys.stdout if stream == 1 else sys.stderr).flush()
            descriptor = os.open(logs.path(attempt, local_rank, stream), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.dup2(descriptor, stream)
            finally:
                os.close(descriptor)


def logged(logs: WorkerLogs | None, *, attempt: int, local_workers: int, shown: tuple[int, ...] | None,
           start: Callable[[], T]) -> T:
    """`start()` (one attempt's workers, to their end) with their log files made first and the tee'd
    ones of the ranks shown copied to the console while they run (`start()` alone without --log-dir)."""
    if logs is None or logs.log_dir is None:
        return start()
    teed = []
    for rank in range(local_workers):
        redirected, tee = logs.streams(rank)
        for stream in STREAMS:
            if (redirected | tee) & stream:
                path = logs.path(attempt, rank, stream)
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.touch()
                except OSError as exc:
                    raise UsageError(f"--log-dir {logs.log_dir}: cannot write {path} ({exc.strerror}); give a "
                                     "directory this user can write") from None
                if tee & stream and (shown is None or rank in shown):
                    teed.append((rank, stream, path, path.stat().st_size))
    with _copied_to_console(teed):
        return start()


@contextlib.contextmanager
def _copied_to_console(files: list[tuple[int, int, Path, int]]) -> Iterator[None]:
    """Lines appended to `files` ((rank, stream, path, offset to start from)) printed while the
    block runs, each after "[rank N]: ", on the launcher's stdout or stderr as the stream."""
    if not files:
        yield
        return
    done = threading.Event()
    thread = threading.Thread(target=_copy, args=(files, done), name="phalanx-tee", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=10)


def _copy(files: list[tuple[int, int, Path, int]], done: threading.Event) -> None:
    offsets = {path: offset for _, _, path, offset in files}
    partial = {path: b"" for _, _, path, _ in files}
    while True:
        last = done.is_set()  # read once more after the workers are done: nothing they wrote is lost
        for rank, stream, path, _ in files:
            data = b""
            with contextlib.suppress(OSError), open(path, "rb") as handle:
                handle.seek(offsets[path])
                data = handle.read()
            if not data and not (last and partial[path]):
                continue
            offsets[path] += len(data)
            *lines, partial[path] = (partial[path] + data).split(b"\n")
            if last and partial[path]:
                lines, partial[path] = [*lines, partial[path]], b""
            out = sys.stdout if stream == 1 else sys.stderr
            with contextlib.suppress(Exception):  # a console gone (phalanx run | head)
                out.write("".join(f"[rank {rank}]: {line.decode(errors='replace')}\n" for line in lines))
                out.flush()
        if last:
            return
        done.wait(POLL_S)
