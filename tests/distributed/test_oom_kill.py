"""A worker the kernel's OOM killer ends, in a memory cgroup as `docker --memory` makes one, is
reported as that, with the fix: "died (signal SIGKILL): the kernel's out-of-memory killer ended
it (... oom_kill count went from 0 to 1) ... use fewer workers (--devices) or a smaller batch".
It was "died (signal SIGKILL)" alone. Needs a writable cgroup v1 memory hierarchy (root)."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
V1 = Path("/sys/fs/cgroup/memory")
LIMIT_BYTES = 1536 * 2**20  # room for a launcher and two workers (~300 MB each), not for rank 1's 2 GiB


def _cgroup(name: str) -> Path | None:
    try:
        path = V1 / name
        path.mkdir()
        (path / "memory.limit_in_bytes").write_text(str(LIMIT_BYTES))
        return path
    except OSError:
        return None


def _remove(cgroup: Path) -> None:
    """rmdir, retried: the kernel holds a cgroup busy for a moment after its last process exits."""
    for _ in range(100):
        try:
            cgroup.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def test_a_worker_the_oom_killer_ends_is_named_as_such(tmp_path):
    cgroup = _cgroup(f"phalanx-test-oom-{os.getpid()}")
    if cgroup is None:
        pytest.skip("no writable cgroup v1 memory hierarchy to hold the run")
    script = tmp_path / "grow.py"
    script.write_text(textwrap.dedent("""
        import phalanx
        world = phalanx.init()
        phalanx.barrier(world=world)
        if world.rank == 1:
            hog = b"x" * 2**31  # written, so every page counts against the cgroup
        phalanx.barrier(world=world)
    """))
    try:
        done = subprocess.run(["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh", sys.executable,
                               "-m", "phalanx", "run", "--devices", "cpu:2", str(script)], capture_output=True,
                              text=True, timeout=180, env={**os.environ, "PYTHONPATH": str(REPO)})
    finally:
        _remove(cgroup)
    failed = [line for line in done.stderr.splitlines() if "failed:" in line]
    assert done.returncode == 1 and failed, done.stderr[-3000:]
    assert failed[0].startswith("phalanx: worker rank 1 failed: died (signal SIGKILL): the kernel's out-of-memory "
                                "killer ended it (this memory cgroup's oom_kill count went from 0 to 1)"), failed[0]
    assert "fewer workers (--devices) or a smaller batch" in failed[0], failed[0]
