"""A process started by spawn or forkserver from a script's unguarded top level, refused in one line.

A process that multiprocessing starts by spawn or forkserver (not fork) begins by running the
main script again, as `__mp_main__`, to find the objects it was handed. Only code under `if
__name__ == "__main__":` stays out of it. A script whose loop sits at its top level (or in a
`main()` called there without the guard) therefore runs again in every such child: the child's
DataLoader starts processes of its own while it is still being set up, and Python stops it with
"An attempt has been made to start a new process before the current process has finished its
bootstrapping phase". Under `phalanx run` each child also called `phalanx.init()` (a warning per
child) and the rank then died of torch's "DataLoader worker exited unexpectedly", which the run's
line could only blame on the dataset's code. This is how DataLoader workers start on macOS
(spawn), on Linux from Python 3.14 (forkserver), and wherever `multiprocessing_context=` says so.

`refusing_unguarded_starts()`, held while a `phalanx run` worker runs the script, wraps
multiprocessing's `spawn.get_preparation_data` (what both methods call in the parent to tell the
child how to rebuild `__main__`): where the child would run the main script again and the
script's top-level statement running now is not an `if __name__ == "__main__":` block (read from
the file's syntax tree), it raises UsageError in the rank, before any child starts, naming the
line and the two fixes. Started from a guarded block, or with no main script to run again (a
notebook), nothing changes.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import sys
from multiprocessing import spawn
from pathlib import Path
from typing import Iterator

from phalanx.errors import UsageError


@contextlib.contextmanager
def refusing_unguarded_starts() -> Iterator[None]:
    """While held, a spawn or forkserver start from the main script's unguarded top level raises UsageError."""
    original = spawn.get_preparation_data

    @functools.wraps(original)
    def checked(name):
        data = original(name)
        name = data.get("init_main_from_name", "__main__")  # `-m pkg.train`; a package's __main__ is not run again
        if "init_main_from_path" in data or not (name == "__main__" or name.endswith(".__main__")):
            where = unguarded_statement()
            if where is not None:
                raise UsageError(unguarded_message(*where))
        return data

    spawn.get_preparation_data = checked
    try:
        yield
    finally:
        spawn.get_preparation_data = original


def unguarded_statement() -> tuple[str, int] | None:
    """(file, line) of the `__main__` module's top-level statement running now, when it is not an
    `if __name__ == "__main__":` block; None when it is, or when no main script is running."""
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") ==
                                     "__main__"):
        frame = frame.f_back
    if frame is None:
        return None
    statements = _top_level(frame.f_code.co_filename)
    line = frame.f_lineno
    running = next((s for s in statements if s.lineno <= line <= (s.end_lineno or s.lineno)), None)
    if running is None or _is_main_guard(running):
        return None
    return frame.f_code.co_filename, line


def unguarded_message(filename: str, line: int) -> str:
    return ("this starts a process by spawn or forkserver (a DataLoader's workers: Python 3.14's way on Linux, spawn "
            "on macOS), which runs the script's top level again before it can work, and line "
            f"{line} of {Path(filename).name}, which led here, is not under `if __name__ == \"__main__\":`; put the "
            "script's code under that guard (as its last block, calling a main()), or pass "
            "multiprocessing_context=\"fork\" to the DataLoader (Linux)")


@functools.lru_cache(maxsize=8)
def _top_level(filename: str) -> tuple[ast.stmt, ...]:
    """The file's top-level statements; none where it cannot be read or parsed (nothing is refused then)."""
    try:
        return tuple(ast.parse(Path(filename).read_text(encoding="utf-8"), filename).body)
    except (OSError, SyntaxError, ValueError):
        return ()


def _is_main_guard(statement: ast.stmt) -> bool:
    """Whether `statement` is an `if` whose test compares `__name__` with "__main__" (either side, in an `and` too)."""
    if not isinstance(statement, ast.If):
        return False
    for node in ast.walk(statement.test):
        if isinstance(node, ast.Compare) and len(node.comparators) == 1:
            sides = {_plain(node.left), _plain(node.comparators[0])}
            if sides == {"name:__name__", "str:__main__"}:
                return True
    return False


def _plain(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return f"name:{node.id}"
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return f"str:{node.value}"
    return None
