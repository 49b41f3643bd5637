"""A segment left in /dev/shm by a creator killed during start-up is removed by the next creator.

A launcher SIGKILLed in the seconds between a worker creating the shm allreduce's segment and
unlinking it (once every rank mapped it) left 24 MiB in /dev/shm for good: no clean-up runs
after SIGKILL, and nothing removed it later (found by an outside operator's trial). Each creator
now first removes the names whose creator is gone, once they are older than any start-up; a
name whose creator runs, or a fresh one (a start-up under way, perhaps in another pid namespace
that shares /dev/shm), stays.
"""

from __future__ import annotations

import os
import time

import pytest

from phalanx.runtime.segment import NAME_PREFIX, SHM_DIR, STALE_AFTER_S, remove_stale_segments, shm_supported

pytestmark = pytest.mark.skipif(shm_supported() is not None, reason=f"no usable {SHM_DIR}")


def _gone_pid() -> int:
    """A pid no process holds now (the top of the range is rarely reached)."""
    with open("/proc/sys/kernel/pid_max") as f:
        top = int(f.read())
    for pid in range(top - 1, top - 10_000, -1):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except OSError:
            continue
    pytest.skip("no free pid near the top of the range")


def test_only_old_names_of_gone_creators_are_removed():
    gone, now = _gone_pid(), time.time()
    old = now - STALE_AFTER_S - 60
    cases = {  # name -> (age's mtime, removed?)
        f"{NAME_PREFIX}{gone}-test-leftover": (old, True),
        f"{NAME_PREFIX}{gone}-board-test-leftover": (old, True),
        f"{NAME_PREFIX}{gone}-test-starting": (now, False),  # young: a start-up may be under way
        f"{NAME_PREFIX}{os.getpid()}-test-running": (old, False),  # its creator runs
        f"{NAME_PREFIX}notapid-test": (old, False),
    }
    paths = {name: os.path.join(SHM_DIR, name) for name in cases}
    try:
        for name, (mtime, _) in cases.items():
            with open(paths[name], "wb") as f:
                f.write(b"x")
            os.utime(paths[name], (mtime, mtime))
        removed = remove_stale_segments(now=now)
        for name, (_, expected) in cases.items():
            assert (name in removed) is expected, name
            assert os.path.exists(paths[name]) is not expected, name
    finally:
        for path in paths.values():
            if os.path.exists(path):
                os.unlink(path)


def test_a_killed_launchers_error_directory_goes_at_the_next_launch(tmp_path, monkeypatch):
    import tempfile

    from phalanx.runtime.worker_errors import ERRORS_PREFIX, error_files

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    old = time.time() - STALE_AFTER_S - 60
    leftover, running = tmp_path / f"{ERRORS_PREFIX}{_gone_pid()}-abc", tmp_path / f"{ERRORS_PREFIX}{os.getpid()}-def"
    for directory in (leftover, running):
        (directory / "0").mkdir(parents=True)
        os.utime(directory, (old, old))
    with error_files(2) as paths:
        assert all(p.startswith(str(tmp_path / f"{ERRORS_PREFIX}{os.getpid()}-")) for p in paths)
        assert not leftover.exists() and running.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [running.name]
