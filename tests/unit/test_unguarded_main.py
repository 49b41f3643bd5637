"""A spawn or forkserver start from a script's unguarded top level is refused in the parent, before
any child runs the script again; from an `if __name__ == "__main__":` block (or with the guard in
an `and`, or reversed) it goes on. The script is run here as `__main__` runs, by exec of its file's
code with `__name__ == "__main__"`; the start is multiprocessing's own preparation step, so no
process is started."""

from __future__ import annotations

import sys
import types
from multiprocessing import spawn

import pytest

from phalanx.errors import UsageError
from phalanx.runtime.unguarded_main import refusing_unguarded_starts, unguarded_statement

_HELPER = """
from multiprocessing import spawn
def start():
    return spawn.get_preparation_data("worker")
def where():
    return unguarded_statement()
"""


def _run_as_main(tmp_path, body: str) -> dict:
    """Run `body` (after the helpers) as python runs a script: a module `__main__` with the file's path."""
    path = tmp_path / "script.py"
    path.write_text(_HELPER + body, encoding="utf-8")
    main = types.ModuleType("__main__")
    main.__file__, main.unguarded_statement = str(path), unguarded_statement
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = main  # what multiprocessing reads to tell a child how to rebuild it
    try:
        exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), main.__dict__)
    finally:
        sys.modules["__main__"] = saved
    return main.__dict__


@pytest.mark.parametrize("body, line", [("result = where()\n", 7), ("if True:\n    result = where()\n", 8),
                                        ("for _ in range(1):\n    result = where()\n", 8)])
def test_an_unguarded_top_level_statement_is_found_with_its_line(tmp_path, body, line):
    file, found = _run_as_main(tmp_path, body)["result"]
    assert (file.endswith("script.py"), found) == (True, line)


@pytest.mark.parametrize("guard", ['__name__ == "__main__"', "'__main__' == __name__",
                                   '__name__ == "__main__" and len([]) == 0'])
def test_a_main_guard_block_is_not_unguarded(tmp_path, guard):
    assert _run_as_main(tmp_path, f"if {guard}:\n    result = where()\n")["result"] is None


def test_a_start_from_the_unguarded_top_level_is_refused_and_one_under_the_guard_goes_on(tmp_path):
    with refusing_unguarded_starts():
        with pytest.raises(UsageError) as info:
            _run_as_main(tmp_path, "start()\n")
        assert str(info.value).startswith("this starts a process by spawn or forkserver (a DataLoader's workers: "
                                          "Python 3.14's way on Linux, spawn on macOS), which runs the script's "
                                          "top level again before it can work, and line 7 of script.py, which led "
                                          "here, is not under `if __name__ == \"__main__\":`")
        assert "multiprocessing_context=\"fork\"" in str(info.value) and "\n" not in str(info.value)
        data = _run_as_main(tmp_path, 'if __name__ == "__main__":\n    result = start()\n')["result"]
        assert data["name"] == "worker"
        assert spawn.get_preparation_data("worker")["name"] == "worker"  # pytest's __main__ is not run again
    assert not hasattr(spawn.get_preparation_data, "__wrapped__")  # put back
