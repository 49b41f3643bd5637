"""Where phalanx keeps what it downloads or builds once per machine: `$XDG_CACHE_HOME/phalanx`,
else `~/.cache/phalanx` (the XDG base-directory rule pip, torch.hub and Hugging Face follow), one
rule for every cache: Fashion-MNIST's files (`fashion-mnist/`, unless $PHALANX_DATA_DIR names
another place) and the compiled shm rounds (`kernels/`). A relative $XDG_CACHE_HOME is ignored,
as the XDG Base Directory specification says: it would put a cache in whatever folder a run
starts from; so would a home that cannot be found (no $HOME, and no password-database entry for
this uid, as in a container started with a bare numeric user): os.path.expanduser leaves "~"
as it is, and the kernels went to ./~/.cache in the working directory. There is no cache then
(`NoCacheHome`): the kernel is built for the process alone and the data falls back as for a
cache that cannot be written."""

from __future__ import annotations

import os
from pathlib import Path


class NoCacheHome(OSError):
    """Neither an absolute $XDG_CACHE_HOME nor a home directory to put phalanx's cache in."""


def cache_root() -> Path:
    """phalanx's cache directory (not created here); NoCacheHome where there is no place for it."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "phalanx"
    home = os.path.expanduser("~")
    if not os.path.isabs(home):
        raise NoCacheHome(f"$HOME is unset and uid {os.getuid()} has no entry in the password database")
    return Path(home) / ".cache" / "phalanx"
