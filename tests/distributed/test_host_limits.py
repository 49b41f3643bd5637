"""A host's limits met before the first step are one line naming the limit and its fix, exit 2,
nothing written to --out: a read-only /tmp (`docker --read-only`; was a 47-line tempfile
traceback), `ulimit -n 14` (was two minutes of c10d retries, then ~300 lines), `ulimit -v 1000000`
(was an ImportError from the workers' imports). A soft limit below the need is raised within the
hard one and the run goes on."""

import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
TRAIN = [sys.executable, "-m", "phalanx", "train", "--devices", "cpu:2", "--dataset", "synthetic", "--epochs", "1",
         "--no-progress", "--threads-per-device", "1"]


def _limited(which: int, soft: int, hard: int):
    return lambda: resource.setrlimit(which, (soft, hard))


def _train(out: Path, *, prefix=(), preexec_fn=None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, *TRAIN, "--out", str(out)], capture_output=True, text=True, timeout=240,
                          preexec_fn=preexec_fn, cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO)})


def _assert_refused(done: subprocess.CompletedProcess, out: Path, *words: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("phalanx: error: "), done.stderr[-3000:]
    assert all(word in lines[0] for word in words), lines[0]
    assert not out.exists()


def test_too_few_file_descriptors_are_one_line(tmp_path):
    out = tmp_path / "run"
    done = _train(out, preexec_fn=_limited(resource.RLIMIT_NOFILE, 14, 14))
    _assert_refused(done, out, "ulimit -n is 14", "ulimit -n 1024")


def test_too_little_address_space_is_one_line(tmp_path):
    out = tmp_path / "run"
    done = _train(out, preexec_fn=_limited(resource.RLIMIT_AS, 1_000_000 * 1024, 1_000_000 * 1024))
    _assert_refused(done, out, "ulimit -v is 1000000", "ulimit -v unlimited")


def test_a_low_soft_limit_is_raised_and_the_run_goes_on(tmp_path):
    out = tmp_path / "run"
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    done = _train(out, preexec_fn=_limited(resource.RLIMIT_NOFILE, 20, hard))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "model.pt").is_file()


def _read_only_tmp_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount --bind /tmp /tmp && mount -o remount,bind,ro /tmp"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.skipif(not _read_only_tmp_works(), reason="unshare -rm (a private mount namespace) is not available")
def test_no_writable_temporary_directory_is_one_line(tmp_path):
    # Every directory tempfile tries is read-only: TMPDIR unset, /tmp, /var/tmp and the working
    # directory (REPO, under /tmp where the suite runs from there; made read-only in the namespace).
    script = ("for d in /tmp /var/tmp \"$PWD\"; do mount --bind \"$d\" \"$d\" && mount -o remount,bind,ro \"$d\" "
              "|| exit 97; done; exec \"$@\"")
    out = Path(os.path.expanduser("~")) / f".phalanx-test-ro-{os.getpid()}"  # outside the read-only /tmp
    env_tmp = {k: v for k, v in os.environ.items() if k not in ("TMPDIR", "TEMP", "TMP")}
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", *TRAIN, "--out", str(out)], capture_output=True,
                          text=True, timeout=240, cwd=REPO, env={**env_tmp, "PYTHONPATH": str(REPO)})
    try:
        assert done.returncode != 97, done.stderr
        _assert_refused(done, out, "no writable temporary directory", "set TMPDIR to a writable directory")
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _out_of_address_space(world):
    # The limit a worker's allocation met: finite here (above what it maps, so nothing else fails).
    resource.setrlimit(resource.RLIMIT_AS, (64 * 2**30, resource.getrlimit(resource.RLIMIT_AS)[1]))
    if world.rank == 1:
        raise MemoryError()
    return world.rank


def test_a_worker_that_meets_a_limit_fails_in_one_line():
    from tests.distributed.harness import WorkersFailed, run_workers

    with pytest.raises(WorkersFailed) as failed:
        run_workers(_out_of_address_space, 2, timeout_s=90)
    message = str(failed.value).split(": ", 1)[1]
    assert message.startswith("run stopped: out of address space (MemoryError"), message
    assert "ulimit -v 67108864" in message and "ulimit -v unlimited" in message and "\n" not in message, message
