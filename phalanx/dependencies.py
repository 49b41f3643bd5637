"""The packages pyproject.toml declares as phalanx's dependencies, and the one line a command
says when any is missing: a `pip install --no-deps` (or a package removed since) otherwise ends
in a traceback, for matplotlib only after the whole run, at its plot, with metrics.jsonl and
model.pt already written. Looked up with `importlib.util.find_spec`, which imports nothing:
0.3 ms for the five, paid by every `phalanx` command before its module (and torch) loads.
"""

from __future__ import annotations

import importlib.util
import sys

# Distribution name (what pip installs) -> the module phalanx imports; the same names as
# pyproject.toml's `dependencies` (tests/unit/test_dependencies.py compares them).
REQUIRED = {"torch": "torch", "numpy": "numpy", "scikit-learn": "sklearn", "matplotlib": "matplotlib",
            "tqdm": "tqdm"}
# What `import phalanx`'s API (and so `phalanx run` of a user's script) imports; scikit-learn (the
# digits) and matplotlib (the plots) are imported only by the commands that train or measure.
API = ("torch", "numpy", "tqdm")


def missing(names: tuple[str, ...] = tuple(REQUIRED)) -> list[str]:
    """Those of `names` (REQUIRED's keys) that this Python cannot import, in REQUIRED's order."""
    return [name for name, module in REQUIRED.items() if name in names and importlib.util.find_spec(module) is None]


def missing_reason(names: tuple[str, ...] = tuple(REQUIRED)) -> str | None:
    """The problem and the fix in one line, or None when every one of `names` is there."""
    absent = missing(names)
    if not absent:
        return None
    what, them = (f"{absent[0]} is", "it") if len(absent) == 1 else (f"{', '.join(absent)} are", "them")
    return (f"{what} not installed in {sys.executable}, and phalanx needs {them} (an install with --no-deps "
            f"skips {them}); pip install {' '.join(absent)}")
