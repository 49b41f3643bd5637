"""What `phalanx run` starts, a file or a module (`-m`), and torchrun's launcher flags given to it.

- Every option torchrun's own parser has is one `phalanx run` takes (`-m`) or names in one line
  (accelerate launch's and fabric run's: tests/unit/test_bad_input_flags.py).
- `Target.check` finds a module as python -m would without running the user's code: a package
  whose `__init__` raises passes the check, and is not imported by it; a package without
  `__main__` is refused naming the fix.
- `run_as_main` runs a module as `python -m` does in this process: `__name__ == "__main__"`, its
  relative import works, sys.argv[0] is its file, sys.path[0] the working directory; sys.argv and
  sys.path are back afterwards, and a `sys.exit(3)` is a failure naming the module and the rank.
"""

from __future__ import annotations

import argparse
import re
import json
import sys

import pytest
from torch.distributed.run import get_args_parser

from phalanx.errors import RunFailed, UsageError
from phalanx.runtime.main_module import Target, run_as_main
from phalanx.runtime.launcher_flags import LAUNCHER_FLAGS
from phalanx.runtime.script import add_run_arguments


def test_every_torchrun_flag_is_taken_or_named():
    # accelerate launch's and fabric run's entries were checked against accelerate 1.15 and Lightning 2.6.6
    # (not installed here): every spelling is theirs, with their nargs
    named = {spelling for _, spellings, _, _ in LAUNCHER_FLAGS for spelling in spellings}
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    ours = {flag for action in parser._actions for flag in action.option_strings} - named  # taken (--max-restarts)
    theirs = {flag for action in get_args_parser()._actions for flag in action.option_strings}
    assert theirs - named - ours == set(), "torchrun flags phalanx run neither takes nor names"
    for launcher, spellings, takes_value, _ in LAUNCHER_FLAGS:  # spelled and valued as torchrun's
        if launcher == "torchrun" and set(spellings) <= theirs:
            action = next(a for a in get_args_parser()._actions if spellings[0] in a.option_strings)
            assert set(action.option_strings) - ours == set(spellings) and (action.nargs != 0) == takes_value, spellings


def _package(root, name: str, *, init: str = "", main: str | None = None) -> None:
    (root / name).mkdir()
    (root / name / "__init__.py").write_text(init)
    (root / name / "helper.py").write_text("VALUE = 41\n")
    if main is not None:
        (root / name / "__main__.py").write_text(main)


def test_a_module_is_found_without_running_its_package(tmp_path, monkeypatch):
    _package(tmp_path, "pkg_unrun", init="raise RuntimeError('the launcher must not import me')\n", main="")
    (tmp_path / "pkg_unrun" / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    Target("pkg_unrun", module=True).check()  # runs pkg_unrun.__main__
    Target("pkg_unrun.train", module=True).check()
    assert "pkg_unrun" not in sys.modules
    with pytest.raises(UsageError, match=r"module pkg_unrun\.nope is not found"):
        Target("pkg_unrun.nope", module=True).check()
    with pytest.raises(UsageError, match=r"module pkg_unrun\.train\.x is not found"):  # a module holds no submodules
        Target("pkg_unrun.train.x", module=True).check()
    Target("json.tool", module=True).check()  # an installed one
    Target("phalanx", module=True).check()  # one already imported, with a __main__


def test_a_package_without_main_is_refused_naming_the_fix(tmp_path, monkeypatch):
    _package(tmp_path, "pkg_nomain")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"^pkg_nomain is a package without a __main__ module, so python -m cannot run "
                                         r"it; name the module to run \(-m pkg_nomain\.train\), or add"):
        Target("pkg_nomain", module=True).check()


def test_a_module_runs_as_python_m_runs_it(tmp_path, monkeypatch):
    out = tmp_path / "seen.json"
    _package(tmp_path, "pkg_runs", main=(
        "import json, sys\nfrom .helper import VALUE\n"
        f"json.dump(dict(name=__name__, spec=__spec__.name, value=VALUE, argv=sys.argv, path0=sys.path[0]), "
        f"open({str(out)!r}, 'w'))\n"))
    monkeypatch.chdir(tmp_path)
    argv, path = sys.argv[:], sys.path[:]
    run_as_main(Target("pkg_runs", module=True), ("--lr", "0.1"), rank=0)
    assert (sys.argv, sys.path) == (argv, path)
    seen = json.loads(out.read_text())
    assert seen == {"name": "__main__", "spec": "pkg_runs.__main__", "value": 41, "path0": str(tmp_path),
                    "argv": [str(tmp_path / "pkg_runs" / "__main__.py"), "--lr", "0.1"]}


def test_a_module_that_exits_with_a_code_fails_naming_it(tmp_path, monkeypatch):
    (tmp_path / "exits_three.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RunFailed, match=r"^exits_three exited with code 3 on rank 1$"):
        run_as_main(Target("exits_three", module=True), (), rank=1)
    assert Target("exits_three", module=True).command == "-m exits_three"
    assert Target("dir/train.py").command == "train.py"


def test_a_script_that_does_not_compile_is_one_line_before_any_worker_starts(tmp_path):
    # Before 2026-12-02 every worker started, and each printed the SyntaxError's traceback.
    script = tmp_path / "train.py"
    script.write_text("import torch\nx = (\n")
    with pytest.raises(UsageError, match=r"^script .*train\.py does not compile \(SyntaxError, line 2: '\(' was never "
                                         r"closed\); fix it and run again$"):
        Target(str(script)).check()
    script.write_text("s = '\\d'\nprint(s)\n")  # a SyntaxWarning only (an invalid escape): it runs
    Target(str(script)).check()


@pytest.mark.parametrize("target, said", [(Target("torch.distributed.run", module=True),
                                            "-m torch.distributed.run is torchrun, a launcher"),
                                           (Target("accelerate.commands.launch", module=True),
                                            "-m accelerate.commands.launch is accelerate launch, a launcher"),
                                           (Target("/usr/bin/torchrun"), "torchrun is a launcher (torchrun's console "
                                                                         "script)")])
def test_another_launcher_as_the_target_is_one_line_before_any_worker_starts(target, said):
    # `phalanx run -m torch.distributed.run --nproc-per-node 2 train.py` (python's line with phalanx run put in)
    # started torchrun on each worker: 2 separate jobs of 2 workers each, every one printed its result, exit 0.
    with pytest.raises(UsageError, match=rf"^{re.escape(said)}: under phalanx run each worker would start workers of "
                                         r"its own, separate jobs that never meet; .* run the script itself: phalanx "
                                         r"run --devices N script\.py"):
        target.check()


def test_a_notebook_is_one_line_naming_the_export_and_launch(tmp_path):
    # A notebook's JSON failed on every rank with "NameError: name 'null' is not defined" (torchrun's too);
    # one whose JSON happens to be valid Python ran as a dict expression and did nothing.
    for name, text in (("train.ipynb", '{"cells": [{"execution_count": null}]}'), ("Train.IPYNB", '{"cells": []}')):
        notebook = tmp_path / name
        notebook.write_text(text)
        with pytest.raises(UsageError) as caught:
            Target(str(notebook)).check()
        line = str(caught.value)
        assert "\n" not in line and f"{name} is a Jupyter notebook" in line
        assert f"jupyter nbconvert --to script {notebook}" in line and "phalanx.launch(fn" in line


@pytest.mark.parametrize("after", [["--n", "5"], ["--b", "1", "--e", "2", "--s", "3", "--co", "--sa", "--nproc"],
                                   ["--devices", "cpu:9", "-m", "--dev", "x", "--quiet"]])
def test_the_scripts_own_options_after_its_name_are_the_scripts(after):
    """argparse matched prefixes of phalanx's flags anywhere: the script's `--n 5` was "ambiguous
    option: --n could match --nnodes, --nproc-per-node" (found by an outside-user trial)."""
    from phalanx.cli import build_parser

    args = build_parser().parse_args(["run", "--devices", "cpu:2", "train.py", *after])
    assert args.script == "train.py" and args.args == after and args.devices == "cpu:2" and not args.quiet
