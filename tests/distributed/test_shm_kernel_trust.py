"""The compiled rounds' cache on a shared host (phalanx/comm/shm_kernel.py): a library another user
planted at the kernel's predictable name, in a cache they can write or own, is never loaded, and
the rounds are built privately instead; a library there that lacks a round is no traceback.

In the distributed tier with test_shm_kernel.py: building the kernel runs the C compiler.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.comm import shm_kernel

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the rounds run in Python here")]


def _kernels(monkeypatch, tmp_path) -> tuple[Path, str]:
    """A fresh cache of this user's with the kernel built in it: its directory and the file's name."""
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    library, reason = shm_kernel.load.__wrapped__()
    assert library is not None, reason
    kernels = tmp_path / "cache" / "phalanx" / "kernels"
    (name,) = [p.name for p in kernels.iterdir()]
    return kernels, name


def _plant(path: Path, marker: Path) -> None:
    """Replace `path` with a library that, once loaded, writes `marker`, and has no round."""
    source = path.with_suffix(".c")
    source.write_text('#include <stdio.h>\n__attribute__((constructor)) static void planted(void) {\n'
                      f'  FILE *f = fopen("{marker}", "w"); if (f) fclose(f);\n}}\n')
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(path), str(source)], check=True, timeout=60)
    source.unlink()


def _loads_the_real_rounds(marker: Path | None) -> None:
    """Load in a fresh process: this one mapped the cached file's path already, and the dynamic
    loader would hand that library back for the path without reading the planted file."""
    code = ("from phalanx.comm import shm_kernel\n"
            "library, reason = shm_kernel.load()\n"
            "print('rounds' if library is not None and hasattr(library, 'phx_small_round') else reason)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert marker is None or not marker.exists(), "a library planted in the cache ran in a run of this user's"
    assert done.returncode == 0 and done.stdout.strip() == "rounds", (done.stdout, done.stderr[-2000:])


def test_a_library_planted_in_a_cache_others_can_write_is_not_loaded(monkeypatch, tmp_path):
    # Before: the planted library's constructor ran in this process, then _declare raised
    # AttributeError (undefined symbol phx_sum_rows) in a traceback on every rank.
    kernels, name = _kernels(monkeypatch, tmp_path)
    marker = tmp_path / "planted-ran"
    _plant(kernels / name, marker)
    kernels.chmod(0o777)  # a shared cache: any user may write it
    _loads_the_real_rounds(marker)
    assert [p.name for p in kernels.iterdir()] == [name], "the foreign cache was built in"


def test_a_library_another_user_owns_is_not_loaded_even_in_ones_own_directory(monkeypatch, tmp_path):
    kernels, name = _kernels(monkeypatch, tmp_path)
    marker = tmp_path / "planted-ran"
    _plant(kernels / name, marker)
    (kernels / name).chmod(0o777)  # another user's kernel would be one they can write
    _loads_the_real_rounds(marker)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_cache_directory_another_user_owns_is_not_used(monkeypatch, tmp_path):
    kernels, name = _kernels(monkeypatch, tmp_path)
    marker = tmp_path / "planted-ran"
    _plant(kernels / name, marker)
    os.chown(kernels, 54321, 54321)  # mode 0700 and still not this user's: its owner chose the file
    _loads_the_real_rounds(marker)


def test_a_library_of_ones_own_that_lacks_a_round_is_rebuilt_privately(monkeypatch, tmp_path):
    # An older or broken build in one's own cache: before, AttributeError and a traceback per rank.
    kernels, name = _kernels(monkeypatch, tmp_path)
    marker = tmp_path / "planted-ran"
    _plant(kernels / name, marker)
    _loads_the_real_rounds(None)  # one's own file may run; the run still gets its rounds


def test_ones_own_cache_is_still_used_without_compiling(monkeypatch, tmp_path):
    _kernels(monkeypatch, tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("compiled again although this user's cache holds the kernel")

    monkeypatch.setattr(subprocess, "run", refuse)
    library, reason = shm_kernel.load.__wrapped__()
    assert library is not None and hasattr(library, "phx_small_round"), reason
