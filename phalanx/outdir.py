"""Where a run's outputs go: checked before any work, so a bad `--out` costs nothing and leaves nothing.

`check_out_dir` refuses, in one line naming the fix, a path that is an existing file, lies under a
directory this user may not write, or cannot be created at all (a virtual filesystem such as
/proc answers "permission" yes and still refuses every mkdir): it creates and at once removes a
probe directory in the nearest existing ancestor. It creates nothing that outlives the check.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from phalanx.errors import UsageError


def check_out_dir(out_dir: str | os.PathLike | None, *, flag: str = "--out") -> None:
    """UsageError unless `out_dir` is (or can be created as) a directory this process can write."""
    if out_dir is None:
        return
    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {out_dir} is an existing file; name a directory instead")
    parent = path if path.exists() else next((p for p in path.parents if p.exists()), Path("."))
    if not parent.is_dir():
        raise UsageError(f"{flag} {out_dir} cannot be created: {parent} is a file; pick another directory")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{flag} {out_dir} is not writable ({parent} denies writing); pick another directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".phalanx-probe-", dir=parent))
    except OSError as exc:
        raise UsageError(f"{flag} {out_dir} cannot be created ({exc.strerror or type(exc).__name__} in {parent}); "
                         "pick a directory on a writable filesystem") from None
