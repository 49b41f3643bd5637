"""The packages pyproject.toml declares as phalanx's dependencies, and the one line a command
says when any is missing: a `pip install --no-deps` (or a package removed since) otherwise ends
in a traceback, for matplotlib only after the whole run, at its plot, with metrics.jsonl and
model.pt already written. Looked up with `importlib.util.find_spec`, which imports nothing:
0.3 ms for the five, paid by every `phalanx` command before its module (and torch) loads.
A torch older than pyproject's floor, which such an install keeps too, is the same one line: its
version is read from torch/version.py as text (0.4 ms; `importlib.metadata` took 2.8 ms).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

# Distribution name (what pip installs) -> the module phalanx imports; the same names as
# pyproject.toml's `dependencies` (tests/unit/test_dependencies.py compares them).
REQUIRED = {"torch": "torch", "numpy": "numpy", "scikit-learn": "sklearn", "matplotlib": "matplotlib",
            "tqdm": "tqdm"}
# What `import phalanx`'s API (and so `phalanx run` of a user's script) imports; scikit-learn (the
# digits) and matplotlib (the plots) are imported only by the commands that train or measure.
API = ("torch", "numpy", "tqdm")
# The oldest torch pyproject.toml's `torch>=` accepts (tests/unit/test_dependencies.py compares
# them); docs/tests.md names the versions the tiers ran on.
TORCH_FLOOR = (2, 4)


def missing(names: tuple[str, ...] = tuple(REQUIRED)) -> list[str]:
    """Those of `names` (REQUIRED's keys) that this Python cannot import, in REQUIRED's order."""
    return [name for name, module in REQUIRED.items() if name in names and importlib.util.find_spec(module) is None]


def missing_reason(names: tuple[str, ...] = tuple(REQUIRED)) -> str | None:
    """The problem and the fix in one line, or None when every one of `names` is there (and torch,
    where named, is new enough)."""
    absent = missing(names)
    if not absent:
        return old_torch_reason() if "torch" in names else None
    what, them = (f"{absent[0]} is", "it") if len(absent) == 1 else (f"{', '.join(absent)} are", "them")
    return (f"{what} not installed in {sys.executable}, and phalanx needs {them} (an install with --no-deps "
            f"skips {them}); pip install {' '.join(absent)}")


def torch_version() -> str | None:
    """The installed torch's version as its torch/version.py says (`2.4.1+cu121`), read without
    importing torch; None where torch or that line is absent."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    try:
        text = Path(spec.origin).with_name("version.py").read_text()
    except OSError:
        return None
    found = re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", text, re.MULTILINE)
    return found.group(1) if found else None


def old_torch_reason() -> str | None:
    """The one line for a torch older than TORCH_FLOOR, or None (a version it cannot read passes)."""
    version = torch_version()
    numbers = re.match(r"(\d+)\.(\d+)", version or "")
    if numbers is None or tuple(int(n) for n in numbers.groups()) >= TORCH_FLOOR:
        return None
    floor = ".".join(str(n) for n in TORCH_FLOOR)
    return (f"torch {version} is installed in {sys.executable}, and phalanx needs torch {floor} or later (an install "
            f"with --no-deps keeps the torch it finds); pip install 'torch>={floor}'")
