"""A `phalanx` command in a Python that lacks one of phalanx's declared dependencies (an install
with --no-deps) ends before it starts, in one line naming the packages and the pip command;
phalanx/dependencies.py's list is pyproject.toml's."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from phalanx.cli import main
from phalanx.dependencies import REQUIRED, TORCH_FLOOR, old_torch_reason, torch_version

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


def test_the_torch_floor_is_pyprojects_and_the_version_is_read_as_torch_says_it():
    tomllib = pytest.importorskip("tomllib", reason="Python 3.10 has no TOML reader (requires-python >= 3.10)")
    import torch

    declared = next(spec for spec in tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
                    if spec.startswith("torch"))
    assert declared == "torch>=" + ".".join(str(n) for n in TORCH_FLOOR)
    assert torch_version() == str(torch.__version__)
    assert old_torch_reason() is None  # this torch is new enough


@pytest.mark.parametrize("command", [["train", "--devices", "1", "--epochs", "1", "--dataset", "synthetic"],
                                     ["run", "--devices", "cpu:2", "train.py"]], ids=["train", "run"])
def test_a_torch_older_than_the_floor_is_one_line_before_anything_starts(command, monkeypatch, tmp_path, capsys):
    # Before: an install with --no-deps kept any torch, and a command went on to whatever that torch
    # lacked; pip enforces torch>=2.4 only when it installs the dependencies.
    monkeypatch.setattr("phalanx.dependencies.torch_version", lambda: "2.3.1+cu121")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("raise SystemExit('must not run')\n")
    code = main([*command, "--out", str(tmp_path / "r1")] if command[0] == "train" else command)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err == (f"phalanx: error: torch 2.3.1+cu121 is installed in {sys.executable}, and phalanx needs torch 2.4 or "
                   "later (an install with --no-deps keeps the torch it finds); pip install 'torch>=2.4'\n")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["train.py"]


@pytest.mark.parametrize("version, refused", [("2.3.1", True), ("1.13.1+cu117", True), ("2.4.0", False),
                                              ("2.10.0", False), ("2.13.0+cpu", False), ("3.0.0a0", False),
                                              ("unknown", False)])
def test_the_floor_compares_major_and_minor_as_numbers(version, refused, monkeypatch):
    monkeypatch.setattr("phalanx.dependencies.torch_version", lambda: version)
    assert (old_torch_reason() is not None) == refused
