"""A host whose loopback interface is down (a network namespace or container with lo down:
`unshare -rn`): `phalanx train` and `phalanx run` on two CPU workers end in one line naming
127.0.0.1 and the fix, exit 2, in seconds, with nothing written to --out (they waited the store's
whole timeout, 148 s, then printed ~300 lines of c10d retries and an EBADF traceback)."""

import shutil
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.distributed

PHALANX = [sys.executable, "-m", "phalanx"]


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=30)
    return probe.returncode == 0


needs_unshare = pytest.mark.skipif(not _unshare_works(),
                                   reason="unshare -rn (an unprivileged network namespace) is not available")


def _in_namespace_without_loopback(argv: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run(["unshare", "-rn", *PHALANX, *argv], capture_output=True, text=True, timeout=120)
    return done, time.monotonic() - started


def _assert_one_line(done: subprocess.CompletedProcess, elapsed_s: float) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith("phalanx: error: cannot reach 127.0.0.1"), lines[0]
    assert "ip link set lo up" in lines[0]
    assert "Bad file descriptor" not in done.stderr
    assert elapsed_s < 30, f"took {elapsed_s:.1f} s"


@needs_unshare
def test_train_with_loopback_down_is_one_line_fast_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    done, elapsed_s = _in_namespace_without_loopback(
        ["train", "--devices", "cpu:2", "--dataset", "synthetic", "--epochs", "1", "--no-progress", "--out", str(out)])
    _assert_one_line(done, elapsed_s)
    assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.iterdir())


@needs_unshare
def test_run_with_loopback_down_is_one_line_fast(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import phalanx
        world = phalanx.init()
        print("started", world.rank)
    """))
    done, elapsed_s = _in_namespace_without_loopback(["run", "--devices", "cpu:2", str(script)])
    _assert_one_line(done, elapsed_s)
    assert "started" not in done.stdout
