"""What `phalanx run` starts on each worker, a Python file or a module (`-m`), run as `__main__` as python runs it.

`Target` is the thing named on the command line: a file's path as given (`train.py`), or with
`-m` a module's dotted name (`pkg.train`), as torchrun's and python's `-m` take it. `check()`
refuses, in the launcher and in one line, a target no worker could run (a missing or unreadable
file, a Jupyter notebook; a module the import system does not find, or a package without
`__main__`) and another launcher (torchrun's module or console script: each worker started workers
of its own, k separate jobs that trained apart, exit 0), without running any of the user's code:
the module is looked up through the import system's finders part by part, not imported.
`run_as_main` runs it in this worker with what `python script.py` / `python -m pkg.train` give it:
sys.argv = [argv0, *args], sys.path[0] the file's directory (a module: the working directory),
`__name__ == "__main__"` (a module's `__spec__` and `__package__` too, so its relative imports work);
a `sys.exit` with a code other than 0 is a failure naming the rank. `inherit_launcher_stdin` gives it
the launcher's stdin, as torchrun's agent gives its workers theirs.
"""

from __future__ import annotations

import builtins
import importlib.machinery
import os
import runpy
import sys
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

from phalanx.errors import RunFailed, UsageError


# Other launchers a target may be by mistake (`phalanx run -m torch.distributed.run ...` for `python -m ...`).
LAUNCHER_MODULES = {"torch.distributed.run": "torchrun", "torch.distributed.launch": "torch.distributed.launch",
                    "accelerate.commands.launch": "accelerate launch",
                    "accelerate.commands.accelerate_cli": "accelerate", "deepspeed.launcher.runner": "deepspeed",
                    "horovod.runner.launch": "horovodrun"}
LAUNCHER_FILES = {"torchrun": "torchrun", "accelerate": "accelerate", "deepspeed": "deepspeed",
                  "horovodrun": "horovodrun"}  # their console scripts, by path (phalanx run $(which torchrun) ...)


@dataclass(frozen=True)
class Target:
    name: str  # a file's path as given, or a module's dotted name
    module: bool = False

    @property
    def shown(self) -> str:
        """How lines name it: the file's name, or the module's."""
        return self.name if self.module else Path(self.name).name

    @property
    def command(self) -> str:
        """What follows `python` (or `phalanx run --devices ...`) to run it."""
        return f"-m {self.name}" if self.module else self.shown

    def check(self) -> None:
        """Refuse a target no worker could run, or one that is another launcher, in one line naming the fix."""
        launcher = LAUNCHER_MODULES.get(self.name) if self.module else LAUNCHER_FILES.get(Path(self.name).name)
        if launcher is not None:  # run, it made k separate jobs of its own workers, which never met
            what = f"{self.command} is {launcher}, a launcher" if self.module else \
                f"{self.shown} is a launcher ({launcher}'s console script)"
            raise UsageError(f"{what}: under phalanx run each worker would start "
                             "workers of its own, separate jobs that never meet; phalanx run is the launcher, so run "
                             "the script itself: phalanx run --devices N script.py (the launcher's flags before the "
                             "script are named in one line each)")
        if self.module:
            _check_module(self.name)
            return
        path = Path(self.name)
        if not path.is_file():
            raise UsageError(f"script {self.name} {'is a directory' if path.is_dir() else 'does not exist'}; "
                             "name a Python file, e.g. phalanx run --devices cpu:2 train.py (or a module: "
                             "-m pkg.train)")
        if not os.access(path, os.R_OK):
            raise UsageError(f"script {self.name} is not readable; check its permissions")
        if path.suffix.lower() == ".ipynb":  # JSON: python (and torchrun) fail on its first `null`
            raise UsageError(f"script {self.name} is a Jupyter notebook, which python cannot run (nor torchrun); "
                             f"export it (jupyter nbconvert --to script {self.name}) and run the .py file, or call "
                             "phalanx.launch(fn, devices=\"cpu:2\") from a cell of the notebook")
        try:  # here, once, not in every worker after the start (and each rank's traceback)
            with warnings.catch_warnings():  # a SyntaxWarning is the workers' to show
                warnings.simplefilter("ignore")
                compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
        except (SyntaxError, ValueError) as exc:
            where = f", line {exc.lineno}" if getattr(exc, "lineno", None) else ""
            raise UsageError(f"script {self.name} does not compile ({type(exc).__name__}{where}: "
                             f"{getattr(exc, 'msg', None) or exc}); fix it and run again") from None


def run_as_main(target: Target, args: tuple[str, ...], *, rank: int) -> None:
    """Run `target` as __main__ in this worker, as `python script.py args` (or `python -m name args`)
    would: a file's sys.argv[0] as given, its `__file__` and sys.path[0] absolute (what a torchrun
    worker sees too, so a script that changes directory still finds itself); a module's
    sys.argv[0] its file, sys.path[0] the working directory."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [target.name, *args]
    try:
        if target.module:
            sys.path.insert(0, os.getcwd())  # python -m's own first entry
            runpy.run_module(target.name, run_name="__main__", alter_sys=True)  # argv[0] becomes its file
        else:
            sys.path.insert(0, str(Path(target.name).resolve().parent))  # python's own: symbolic links resolved
            _run_file(os.path.abspath(target.name))
    except SystemExit as exc:  # sys.exit() / argparse in the script
        detail = failed_exit(exc)
        if detail is not None:
            raise RunFailed(f"{target.shown} exited with {detail} on rank {rank}") from None
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def failed_exit(exc: SystemExit) -> str | None:
    """How a `sys.exit()` failed, as a process's exit status reads it (`code 3`, or the message's
    repr), or None for success: code 0 or none."""
    if exc.code in (None, 0):
        return None
    return f"code {exc.code}" if isinstance(exc.code, int) else repr(exc.code)


def _run_file(path: str) -> None:
    """Run the Python file at `path` (absolute) as `python path` runs it: in a fresh `__main__`
    module whose `__file__` is `path`, sys.argv left as it is (runpy.run_path would set argv[0]
    to `path` too, where python and torchrun keep it as given); the previous `__main__` is back
    afterwards."""
    code = compile(Path(path).read_bytes(), path, "exec")
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=path, __cached__=None, __package__=None, __spec__=None, __builtins__=builtins,
                           __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = module
    try:
        exec(code, module.__dict__)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


_UNKNOWN = object()  # a finder failed: the worker's own import will say what is wrong


def _check_module(name: str) -> None:
    if not name or any(not part.isidentifier() for part in name.split(".")):
        raise UsageError(f"-m {name!r} is not a module name; name it as python -m takes it, e.g. -m pkg.train")
    saved_path = sys.path[:]
    sys.path.insert(0, os.getcwd())  # where python -m looks first
    try:
        spec = _find(name)
        runs = spec if spec is None or spec is _UNKNOWN or spec.submodule_search_locations is None \
            else _find(f"{name}.__main__")
    finally:
        sys.path[:] = saved_path
    if spec is None:
        top = name.split(".")[0]
        raise UsageError(f"module {name} is not found (python -m {name} would say 'No module named {name}'): "
                         f"check its name, or run from the directory that holds {top}/ (or {top}.py), or install it")
    if runs is None:
        raise UsageError(f"{name} is a package without a __main__ module, so python -m cannot run it; "
                         f"name the module to run (-m {name}.train), or add {name}/__main__.py")


def _find(name: str):
    """The spec the import system would find for dotted `name`, None if none, or _UNKNOWN; each
    parent package's locations are looked up, never imported (no __init__ of the user's runs)."""
    path, spec = None, None
    parts = name.split(".")
    for depth in range(len(parts)):
        if depth and path is None:
            return None  # a module, not a package: it holds no submodules
        full = ".".join(parts[:depth + 1])
        loaded = sys.modules.get(full)
        spec = getattr(loaded, "__spec__", None) if loaded is not None else _find_one(full, path)
        if spec is None or spec is _UNKNOWN:
            return spec if loaded is None else _UNKNOWN
        path = spec.submodule_search_locations
    return spec


def _find_one(full: str, path):
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(full, path)
        except Exception:  # noqa: BLE001 - a finder of someone else's: leave the verdict to the worker
            return _UNKNOWN
        if spec is not None:
            return spec
    return None


def inherit_launcher_stdin() -> None:
    """sys.stdin: fd 0, the launcher's stdin (multiprocessing gave Python /dev/null), as a torchrun worker
    reads its agent's: `breakpoint()` and `input()` read the terminal instead of ending the run with
    BdbQuit / EOFError at once (torch.distributed.breakpoint() opens /dev/stdin and worked either way)."""
    try:
        os.fstat(0)
    except OSError:  # closed: /dev/null stays
        return
    sys.stdin = open(0, encoding="utf-8", closefd=False)
