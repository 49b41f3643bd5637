"""Where a run's outputs go: checked before any work, so a bad `--out` costs nothing and leaves nothing.

`check_out_dir` refuses, in one line naming the fix, an empty path (it would silently write
nothing), a path that is an existing file, a dangling symlink or a loop of symlinks (on the path
or on a parent still to be created: mkdir cannot go through either), one that lies under a
directory this user may not write, or one that cannot be created at all (a virtual filesystem
such as /proc answers "permission" yes and still refuses every mkdir): it creates and at once
removes a probe directory in the nearest existing ancestor. It creates nothing that outlives the check.
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
    if not os.fspath(out_dir):
        raise UsageError(f"{flag} is empty; name a directory, or drop {flag}")
    check_path_length(out_dir, flag=flag)
    path = Path(out_dir)
    broken = _broken_link(path)
    if broken is not None:
        link, what = broken
        where = "" if link == path else f" cannot be created: {link}"
        raise UsageError(f"{flag} {out_dir}{where} is {what}; point the link at a directory, "
                         "remove it, or pick another directory")
    try:
        if path.exists() and not path.is_dir():
            raise UsageError(f"{flag} {out_dir} is an existing file; name a directory instead")
        parent = path if path.exists() else next((p for p in path.parents if p.exists()), Path("."))
    except OSError as exc:  # e.g. a loop of symlinks
        raise UsageError(f"{flag} {_shorten(os.fspath(out_dir))} cannot be used ({exc.strerror}); "
                         "pick another directory") from None
    if not parent.is_dir():
        raise UsageError(f"{flag} {out_dir} cannot be created: {parent} is a file; pick another directory")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{flag} {out_dir} is not writable ({parent} denies writing); pick another directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".phalanx-probe-", dir=parent))
    except OSError as exc:
        raise UsageError(f"{flag} {out_dir} cannot be created ({exc.strerror or type(exc).__name__} in {parent}); "
                         "pick a directory on a writable filesystem") from None


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
