"""What `pip install phalanx` (a wheel, not this checkout) carries: the version declared once,
and every file the package reads at run time beside its modules."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest

import phalanx

tomllib = pytest.importorskip("tomllib", reason="Python 3.10 has no TOML reader (requires-python >= 3.10)")

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_version_is_declared_once():
    # Before, pyproject.toml and phalanx/__init__.py each spelled "0.1.0": a bump of one left
    # `pip show phalanx` and `phalanx --version` (and metrics.jsonl's "phalanx") apart.
    assert "version" not in PROJECT["project"] and "version" in PROJECT["project"]["dynamic"]
    assert PROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "phalanx.__version__"}
    assert phalanx.__version__


def test_every_data_file_of_the_package_is_in_the_wheel():
    package_data = PROJECT["tool"]["setuptools"]["package-data"]
    for path in (ROOT / "phalanx").rglob("*"):
        if not path.is_file() or path.suffix in (".py", ".pyc"):
            continue
        package = ".".join(path.parent.relative_to(ROOT).parts)
        globs = package_data.get(package, []) + package_data.get("*", [])
        assert any(fnmatch.fnmatch(path.name, g) for g in globs), f"{path.relative_to(ROOT)} is left out of the wheel"
