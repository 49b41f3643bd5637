"""Where phalanx keeps what it downloads or builds once per machine: `$XDG_CACHE_HOME/phalanx`,
else `~/.cache/phalanx` (the XDG base-directory rule pip, torch.hub and Hugging Face follow), one
rule for every cache: Fashion-MNIST's files (`fashion-mnist/`, unless $PHALANX_DATA_DIR names
another place) and the compiled shm rounds (`kernels/`). A relative $XDG_CACHE_HOME is ignored,
as the XDG Base Directory specification says: it would put a cache in whatever folder a run
starts from."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """phalanx's cache directory (not created here)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "phalanx"
