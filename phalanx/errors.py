"""The exception types whose message is the whole story, so the terminal shows no traceback.

`UsageError`: the user gave us something we cannot use; one line naming the problem and the
fix, exit code 2 (see `phalanx.cli`); `Misuse` is one made in a call of the script's own code.
`RunFailed`: a run stopped on a condition phalanx checks for (a NaN loss, replicas that drifted
apart, an output that could not be written: `WriteFailed`); one line naming what happened and
what to try, exit code 1. `Stopped`: the launcher was told to stop by a signal, exit code 128 +
its number. Every other exception is a bug or an environment failure and keeps its traceback.
"""

import errno
import os

# Where phalanx's own files lie: a frame whose file starts with it is phalanx's, not the user's.
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class UsageError(Exception):
    """Bad input: the message names the problem and the fix, in one line."""

    exit_code = 2


class Misuse(UsageError, RuntimeError):
    """A call in the script's own code that the replica refuses (a step out of order, an optimizer
    over the whole parameters under `shard=`): one line led by the script's line, exit 2, as bad
    input is. Still a RuntimeError, what torch and DDP raise for such calls, so code that catches
    those keeps catching it."""


class RunFailed(RuntimeError):
    """A checked condition stopped the run; the message names step, rank and the fix, in one line.

    `restartable`: whether starting the workers again from a checkpoint can get past it - False
    for what would repeat (a NaN loss, drifted replicas, mismatched collectives: the program's own
    doing); a subclass for what comes from outside (a worker that stopped responding) says True,
    and names the rank it blames as `culprit`; `--max-restarts` then treats it like a death."""

    exit_code = 1
    restartable = False
    culprit: int | None = None


FREE_SPACE = "free space there or choose another directory"
# The fix a failed write's reason calls for: "free space there" told a run whose --out was deleted
# under it (ENOENT) or that met `ulimit -f` (EFBIG) to do what would not help.
_WRITE_FIXES = {errno.ENOENT: "its directory was removed while the run wrote there; choose a directory nothing "
                              "else removes and resume from the last checkpoint if one is left",
                errno.EFBIG: "the file is larger than this process may write (ulimit -f, a filesystem's file-size "
                             "limit); raise the limit (ulimit -f unlimited) or choose another filesystem",
                errno.EROFS: "the filesystem is mounted read-only; choose a writable directory",
                errno.EACCES: "this user may not write there; fix its permissions or choose another directory"}


def write_fix(exc: OSError) -> str:
    """What to do about a write that failed with `exc`, read from its errno (free space by default)."""
    return _WRITE_FIXES.get(exc.errno, FREE_SPACE)


class WriteFailed(RunFailed, OSError):
    """Writing an output failed (a full disk, a quota, a read-only filesystem): one line naming the
    file and the system's reason, exit code 1. Still an OSError (same errno and strerror), so a
    caller that handles a failed write itself keeps doing so."""

    @classmethod
    def of(cls, path, exc: OSError) -> "WriteFailed":
        failed = cls(f"cannot write {path} ({exc.strerror or type(exc).__name__}); {write_fix(exc)}")
        failed.errno, failed.strerror = exc.errno, exc.strerror
        return failed

    def __str__(self) -> str:
        return str(self.args[0])


class PeerLost(RuntimeError):
    """Raised on a rank because another rank failed, died or is shutting down while this one
    waited for it: the other rank's own report is the cause, this one its echo (the launcher
    prints "rank r stopped too"). The collectives' peer-died and abort errors are this kind."""


class PhalanxWarning(UserWarning):
    """A run that trains, but not as written means (silence with warnings.filterwarnings)."""


def frame_outside(skip_dirs: tuple[str, ...] = (PACKAGE_DIR,), *, start=None) -> tuple:
    """The first frame, from `start` (default: this function's caller) outward, whose file lies in
    none of `skip_dirs`, and how many frames were passed on the way: the script's line behind
    phalanx's own calls. The outermost frame when every frame is skipped."""
    import sys

    frame, passed = start or sys._getframe(1), 0
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(skip_dirs):
        frame, passed = frame.f_back, passed + 1
    return frame, passed


def script_frame(start):
    """The first frame from `start` outward outside phalanx and torch: the script's line behind
    torch's own calls (an optimizer's step hooks, a DataLoader drawing from its sampler)."""
    return frame_outside((PACKAGE_DIR, _torch_dir()), start=start)[0]


def _torch_dir() -> str:
    import sys

    return os.path.dirname(os.path.abspath(sys.modules["torch"].__file__)) + os.sep


def frame_values(frame, *, depth: int = 8):
    """(name, value) of each local of `frame` and the frames above it, `depth` frames in all, and of
    the script's globals where a frame is the script's (__main__), innermost first: what a loop that
    steps an optimizer holds (its loaders, its model), a few frames up when a helper takes the step."""
    for _ in range(depth):
        if frame is None:
            return
        scopes = [frame.f_locals] + ([frame.f_globals] if frame.f_globals.get("__name__") == "__main__" else [])
        yield from [item for scope in scopes for item in list(scope.items())]
        frame = frame.f_back


def script_line(start) -> tuple[str, int, str]:
    """Where a warning about the script's doing points, from frame `start` outward: the line its
    author can change (`authors_frame`: `trainer.run(loader)`, past PyTorch-Ignite's Engine that drew
    from the sampler), as (file, line, note), the note naming the installed library's line in between
    ("" where none: " (reached in ignite.engine.engine, line 1216)"). Where no such frame lies outward
    (a script run from installed code), script_frame's, with no note."""
    first = frame = script_frame(start)
    walked = []
    while frame is not None:
        walked.append((frame.f_code.co_filename, frame.f_lineno,
                       frame.f_globals.get("__name__") or os.path.basename(frame.f_code.co_filename)))
        frame = frame.f_back
    found = authors_frame(walked)
    if found is None:
        return first.f_code.co_filename, first.f_lineno, ""
    (path, line, _), library = found
    return path, line, "" if library is None else f" (reached in {library[2]}, line {library[1]})"


def authors_frame(frames: list[tuple[str, int, str]]) -> tuple[tuple[str, int, str], tuple | None] | None:
    """Of `frames` ((file, line, module), innermost first: a live stack's or a traceback's), the line
    its author can change: the innermost outside phalanx, torch, the standard library and installed
    packages (site-packages), a script's or a module of its own; with the innermost frame of an
    installed library when one came between (timm's train.py wraps DDP inside timm.task; the standard
    library's, argparse's, is not named), else None. Where every frame is a library's: the innermost
    outside phalanx and torch, with None; None where every frame is phalanx's or torch's."""
    import sysconfig

    paths = sysconfig.get_paths()
    stdlib = os.path.abspath(paths["stdlib"]) + os.sep
    installed = (stdlib, *(os.path.abspath(paths[name]) + os.sep for name in ("purelib", "platlib")))
    ours = (PACKAGE_DIR, _torch_dir())
    outside = [frame for frame in frames if not os.path.abspath(frame[0]).startswith(ours)]
    author = next((frame for frame in outside if not _installed(frame[0], installed)), None)
    if author is None:
        return (outside[0], None) if outside else None
    between = outside[:outside.index(author)]
    return author, next((frame for frame in between if not standard_library(frame[0], stdlib)), None)


def standard_library(filename: str, stdlib: str) -> bool:
    """Whether `filename` is the standard library's own (a site-packages folder inside it is not)."""
    return filename.startswith("<frozen") or (os.path.abspath(filename).startswith(stdlib) and not _packaged(filename))


def _installed(filename: str, installed: tuple[str, ...]) -> bool:
    """Whether `filename` is the standard library's or an installed package's ("<frozen runpy>" too)."""
    return filename.startswith("<frozen") or os.path.abspath(filename).startswith(installed) or _packaged(filename)


def _packaged(filename: str) -> bool:
    """Whether `filename` lies in a site-packages or dist-packages folder (an installed package's)."""
    return not {"site-packages", "dist-packages"}.isdisjoint(os.path.abspath(filename).split(os.sep))


def warn_at_caller(message: str) -> None:
    """A PhalanxWarning pointing at the first frame outside phalanx: the script's line that led
    here, however many of phalanx's own calls (prepare, DataParallel(...)) lie between."""
    import sys
    import warnings

    _, passed = frame_outside(start=sys._getframe(1))
    warnings.warn(message, PhalanxWarning, stacklevel=2 + passed)  # stacklevel 2: this function's caller


class Interrupted(KeyboardInterrupt):
    """Ctrl-C reached the launcher, and its workers have been taken down; `where`: one line per
    worker that was still working, where it was then ("rank 1 at train.py:40 (load)")."""

    def __init__(self, where: list[str]) -> None:
        super().__init__(*(["where each rank was: " + "; ".join(where)] if where else []))  # a notebook shows it
        self.where = where


class Stopped(BaseException):
    """The launcher was told to stop (SIGTERM from `timeout`, a scheduler, a container stop, or
    SIGHUP); its workers have been taken down. `detail`: where a training run stopped and what it
    saved (runtime/stop_request.py), when it did. A BaseException, like KeyboardInterrupt, so no
    `except Exception` on the way swallows it."""

    def __init__(self, signum: int, *, detail: str | None = None) -> None:
        import signal

        self.signum, self.detail = signum, detail
        self.exit_code = 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name}" + (f" {detail}" if detail else ""))
