"""Where a run's outputs go: checked before any work, so a bad `--out` costs nothing and leaves nothing.

The one check of an output flag for every command: `check_out_dir` for a directory flag
(`phalanx train`, bench, predict, sweep: --out, --trace, --checkpoint-dir), `check_out_file` for a
file flag (`phalanx verify --out FILE`). Each refusal is one line naming the fix.

Both refuse an empty path (it would silently write nothing) and a dangling symlink or a loop of
symlinks (on the path or on a parent still to be created: mkdir cannot go through either).
`check_out_dir` also refuses a path that is an existing file, lies under a directory this user
may not write, or cannot be created at all (a virtual filesystem such as /proc answers
"permission" yes and still refuses every mkdir): it creates and at once removes a probe directory
in the nearest existing ancestor. It creates nothing that outlives the check.
`check_out_file` refuses a directory, a file whose directory does not exist, or one where no file
can be written (the same kind of probe).
`write_refusal` is the same probe for a place that is optional (a cache): the reason, or None.
`check_path_length` refuses a path the system cannot name (a component over the filesystem's
name limit, usually 255 bytes, or a whole path over PATH_MAX), which would otherwise surface as
an `OSError: File name too long` traceback from deep inside a run; --data-dir is checked too.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from phalanx.errors import UsageError

_DEFAULT_NAME_MAX, _DEFAULT_PATH_MAX = 255, 4096


def check_path_length(path: str | os.PathLike | None, *, flag: str) -> None:
    """UsageError when `path` has a component longer than its filesystem allows, or is too long."""
    if path is None:
        return
    full = os.path.abspath(os.path.expanduser(os.fspath(path)))
    existing = next(p for p in (full, *map(str, Path(full).parents)) if os.path.exists(p))
    name_max = _limit(existing, "PC_NAME_MAX", _DEFAULT_NAME_MAX)
    path_max = _limit(existing, "PC_PATH_MAX", _DEFAULT_PATH_MAX)
    longest = max(os.fsencode(full).split(b"/"), key=len)
    if len(longest) > name_max:
        raise UsageError(f"{flag} {_shorten(os.fspath(path))} has a name of {len(longest)} bytes, longer than the "
                         f"{name_max} bytes this filesystem allows; use a shorter name")
    if len(os.fsencode(full)) >= path_max:
        raise UsageError(f"{flag} {_shorten(os.fspath(path))} is {len(os.fsencode(full))} bytes long, longer than the "
                         f"{path_max - 1} bytes a path may have here; use a shorter path")


def _limit(existing: str, name: str, default: int) -> int:
    try:
        return os.pathconf(existing, name)
    except (OSError, ValueError):
        return default


def _shorten(text: str, keep: int = 60) -> str:
    return text if len(text) <= keep else f"{text[:keep // 2]}...{text[-keep // 2:]}"


def check_out_dir(out_dir: str | os.PathLike | None, *, flag: str = "--out") -> None:
    """UsageError unless `out_dir` is (or can be created as) a directory this process can write."""
    if out_dir is None:
        return
    path = _checked_path(out_dir, flag=flag, noun="directory")
    try:
        if path.exists() and not path.is_dir():
            raise UsageError(f"{flag} {out_dir} is an existing file; name a directory instead")
        parent = path if path.exists() else next((p for p in path.parents if p.exists()), Path("."))
    except OSError as exc:  # e.g. a loop of symlinks
        raise UsageError(f"{flag} {_shorten(os.fspath(out_dir))} cannot be used ({exc.strerror}); "
                         "pick another directory") from None
    if not parent.is_dir():
        raise UsageError(f"{flag} {out_dir} cannot be created: {parent} is a file; pick another directory")
    _probe(parent, f"{flag} {out_dir}", "cannot be created", noun="directory")


def check_out_file(out_file: str | os.PathLike | None, *, flag: str = "--out") -> None:
    """UsageError unless `out_file` names a file that can be written in an existing directory."""
    if out_file is None:
        return
    path = _checked_path(out_file, flag=flag, noun="file")
    if path.is_dir():
        raise UsageError(f"{flag} {out_file} is a directory; name a file, e.g. {flag} {path / 'report.json'}")
    parent = path.parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {out_file}: directory {parent} does not exist; create it or pick another path")
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{flag} {out_file} is not writable; pick another path")
    _probe(parent, f"{flag} {out_file}", "cannot be written", noun="path")


def write_refusal(directory: Path) -> str | None:
    """Why no file could be created in `directory` (where it does not exist yet, in the nearest
    existing ancestor it would be made in), as a clause for a message; None when one could. The
    same probe as the output checks', without their UsageError: for a cache, which is optional."""
    try:
        parent = directory if directory.exists() else next((p for p in directory.parents if p.exists()), Path("."))
    except OSError as exc:  # e.g. a loop of symlinks
        return exc.strerror or type(exc).__name__
    if not parent.is_dir():
        return f"{parent} is a file"
    if not os.access(parent, os.W_OK):
        return f"{os.path.abspath(parent)} denies writing"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".phalanx-probe-", dir=parent))
    except OSError as exc:
        return f"{exc.strerror or type(exc).__name__} in {parent}"
    return None


def _probe(parent: Path, named: str, failure: str, *, noun: str) -> None:
    """UsageError unless this process may create an entry in `parent`: by its mode bits, then by a
    probe directory created and removed at once (/proc and its kind say "writable" and refuse)."""
    if not os.access(parent, os.W_OK):  # absolute: "(. denies writing)" left the user to work out which "."
        raise UsageError(f"{named} is not writable ({os.path.abspath(parent)} denies writing); pick another {noun}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".phalanx-probe-", dir=parent))
    except OSError as exc:
        raise UsageError(f"{named} {failure} ({exc.strerror or type(exc).__name__} in {parent}); "
                         f"pick a {noun} on a writable filesystem") from None


def _checked_path(out: str | os.PathLike, *, flag: str, noun: str) -> Path:
    """`out` as a Path, once it is neither empty, too long, nor behind a broken symlink."""
    if not os.fspath(out):
        raise UsageError(f"{flag} is empty; name a {noun}, or drop {flag}")
    check_path_length(out, flag=flag)
    path = Path(out)
    broken = _broken_link(path)
    if broken is not None:
        link, what = broken
        where = "" if link == path else f" cannot be created: {link}"
        raise UsageError(f"{flag} {out}{where} is {what}; point the link at a {noun}, remove it, or pick another {noun}")
    return path


def _broken_link(path: Path) -> tuple[Path, str] | None:
    """(the link, what is wrong) where `path`, or the nearest of its parents that does not resolve,
    is a symlink leading nowhere (dangling) or to itself (a loop); None when every link resolves."""
    for candidate in (path, *path.parents):
        if os.path.exists(candidate):
            return None  # from here up the path resolves
        if os.path.islink(candidate):
            try:
                os.stat(candidate)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    return candidate, "a loop of symlinks"
                return candidate, f"a symlink to {os.readlink(candidate)}, which does not exist"
    return None
