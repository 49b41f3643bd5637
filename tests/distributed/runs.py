"""Whole `phalanx` runs started as a user starts them, for the tests that judge what a run leaves
behind (resume, elastic restarts, the --out lock): run or start `python -m phalanx ...` - or a
driver script that patches something first, then calls the CLI - with a deadline, read back its
metrics rows and final weights, and compare two runs' outputs. Every wait has a deadline, and
nothing started by `started_phalanx` outlives its block (its whole process group is killed).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Iterator

import pytest
import torch

TIMEOUT_S = 240  # a few epochs of LeNet on synthetic data, on a shared 2-core machine, with room

# A driver script: rank 0 SIGKILLs itself right after the checkpoint at epoch 2, step 10 lands.
# The patch is at module level, so the spawned workers (which re-import the main module) run it too.
CRASH_AFTER_CHECKPOINT = textwrap.dedent("""
    import os, signal
    from phalanx.train import checkpoint as ckpt
    real_save = ckpt.save_checkpoint
    def save_then_crash(directory, **kw):
        path = real_save(directory, **kw)
        if path is not None and (kw["position"].epoch, kw["position"].step) == (1, 10):
            os.kill(os.getpid(), signal.SIGKILL)  # rank 0, right after the file landed
        return path
    ckpt.save_checkpoint = save_then_crash
    if __name__ == "__main__":
        import sys
        from phalanx.cli import main
        sys.exit(main(sys.argv[1:]))
""")


# A driver script: the worker on device DEAD_DEVICE (e.g. "cpu:1") that starts from a checkpoint
# kills itself at once, as a worker on a device that failed for good dies at every restart - so
# --elastic must go on without it. Patched at module level (the spawned workers re-import it).
DEAD_ON_RESUME = textwrap.dedent("""
    import os, signal
    from phalanx.job import job
    real_run = job._run
    def run_or_die(strategy, *, world, config, device_names, **kw):
        if config.checkpoint.resume is not None and world.distributed and device_names[world.rank] == os.environ["DEAD_DEVICE"]:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_run(strategy, world=world, config=config, device_names=device_names, **kw)
    job._run = run_or_die
    if __name__ == "__main__":
        import sys
        from phalanx.cli import main
        sys.exit(main(sys.argv[1:]))
""")


def dead_on_resume_script(directory: Path) -> Path:
    """DEAD_ON_RESUME written into `directory`, ready for `script=` (the device named by DEAD_DEVICE)."""
    script = directory / "dead_on_resume.py"
    script.write_text(DEAD_ON_RESUME)
    return script


def _entry(script: Path | None) -> list[str]:
    return [sys.executable, str(script)] if script else [sys.executable, "-m", "phalanx"]


def crash_script(directory: Path) -> Path:
    """CRASH_AFTER_CHECKPOINT written into `directory`, ready for `script=`."""
    script = directory / "crash_after_checkpoint.py"
    script.write_text(CRASH_AFTER_CHECKPOINT)
    return script


def run_phalanx(*args: str, script: Path | None = None, timeout_s: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """`phalanx *args` (or `python script *args`) to its end, output captured; past timeout_s it is killed."""
    return subprocess.run([*_entry(script), *args], capture_output=True, text=True, timeout=timeout_s)


def finished_run(out: Path, *args: str, timeout_s: float = TIMEOUT_S) -> Path:
    """Run `phalanx *args --out out`, which must succeed; `out`, e.g. as the reference a test compares with."""
    done = run_phalanx(*args, "--out", str(out), timeout_s=timeout_s)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def start_phalanx(*args: str, script: Path | None = None) -> subprocess.Popen:
    """`phalanx *args` started in the background, stdout and stderr piped; `finish` waits for it."""
    return subprocess.Popen([*_entry(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, *, timeout_s: float = TIMEOUT_S) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a `start_phalanx` run; past timeout_s it is killed and the test fails."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, stdout, stderr


@contextlib.contextmanager
def started_phalanx(*args: str, env: dict[str, str] | None = None,
                    script: Path | None = None) -> Iterator[subprocess.Popen]:
    """`phalanx *args` in a session of its own (signals for it - a Ctrl-C, a kill - reach its workers
    too), with `env` added to this process's environment; on leaving the block, however it is left,
    whatever of it still runs is SIGKILLed, launcher and workers."""
    proc = subprocess.Popen([*_entry(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=None if env is None else {**os.environ, **env})
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def metrics_rows(out: Path) -> list[dict]:
    """The run's metrics.jsonl, one dict per epoch row."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def final_weights(got: Path, want: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The model.pt state dicts of two runs, which must name the same tensors."""
    a = torch.load(got / "model.pt", weights_only=True)
    b = torch.load(want / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    return a, b


def relative_difference(got: Path, want: Path) -> float:
    """The largest, over the model's tensors, of max|got - want| / max|want| (an all-zero `want`
    tensor counts as 1e-300, so a difference there shows as huge instead of nan)."""
    a, b = final_weights(got, want)
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-300)).item() for k in b)


def assert_same_rows(got: Path, want: Path, *, rel: float) -> None:
    """Both runs wrote epochs 1 and 2 with train losses within `rel` and the very same accuracies."""
    rows_a, rows_b = metrics_rows(got), metrics_rows(want)
    assert [r["epoch"] for r in rows_a] == [r["epoch"] for r in rows_b] == [1, 2]
    for ra, rb in zip(rows_a, rows_b):
        assert ra["train_loss"] == pytest.approx(rb["train_loss"], rel=rel, abs=0), ra["epoch"]
        assert (ra["train_acc"], ra["test_acc"]) == (rb["train_acc"], rb["test_acc"]), ra["epoch"]


def flip_record_byte(path: Path) -> str:
    """Flip one bit in the middle of the largest tensor record of the checkpoint at `path` (the zip
    structure stays intact; only that record's CRC-32 no longer matches); return the record's name."""
    with zipfile.ZipFile(path) as archive:
        record = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[record.header_offset + 26:record.header_offset + 30])
    data[record.header_offset + 30 + name_len + extra_len + record.file_size // 2] ^= 0x10
    path.write_bytes(bytes(data))
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() == record.filename  # damaged in place, as a disk or a copy would
    return record.filename
