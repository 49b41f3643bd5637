"""A `phalanx` command in a Python that lacks one of phalanx's declared dependencies (an install
with --no-deps) ends before it starts, in one line naming the packages and the pip command;
phalanx/dependencies.py's list is pyproject.toml's."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from phalanx.cli import main
from phalanx.dependencies import REQUIRED

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_the_checked_packages_are_the_declared_dependencies():
    tomllib = pytest.importorskip("tomllib", reason="Python 3.10 has no TOML reader (requires-python >= 3.10)")
    declared = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    assert [re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0] for spec in declared] == list(REQUIRED)


def test_a_missing_dependency_is_one_line_before_the_run_writes_anything(monkeypatch, tmp_path, capsys):
    # Before: matplotlib missing trained the whole run, wrote metrics.jsonl and model.pt, then
    # ended in a ModuleNotFoundError traceback at the plot.
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # find_spec and import both see it absent
    monkeypatch.setitem(sys.modules, "sklearn", None)
    out = tmp_path / "r1"
    code = main(["train", "--devices", "1", "--epochs", "1", "--dataset", "synthetic", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err == (f"phalanx: error: scikit-learn, matplotlib are not installed in {sys.executable}, and phalanx "
                   "needs them (an install with --no-deps skips them); pip install scikit-learn matplotlib\n")
    assert not out.exists()


def test_the_version_needs_no_dependency(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("phalanx ")


def test_run_needs_only_what_the_api_imports(monkeypatch, capsys):
    # A user's own script under phalanx run needs neither the digits nor the plots.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "sklearn", None)
    assert main(["run", "--devices", "cpu:2", "no-such-script.py"]) == 2
    assert "script no-such-script.py does not exist" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "tqdm", None)
    assert main(["run", "--devices", "cpu:2", "no-such-script.py"]) == 2
    assert "tqdm is not installed in" in capsys.readouterr().err
