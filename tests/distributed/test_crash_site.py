"""A worker that dies of a fatal signal (SIGSEGV in compiled code, os.abort) is reported with where
it was: `phalanx run`'s failure line names the script's line and the innermost frame, and the rank's
section holds its Python stack (runtime/crash_site.py), with no faulthandler dump on the terminal.
A rank busy elsewhere while its peer's collective ran out of time is named with the line it was at
and its stack (before 2026-12-07: its process state, "sleeping", and no place); and Ctrl-C on a run
that seems stuck says where each rank was (before: "phalanx: interrupted" alone).
Before 2026-12-07: "died (signal SIGSEGV)" alone, as torchrun's "Signal 11 (SIGSEGV) received by
PID". A script that enables faulthandler itself keeps it (so does a run under PYTHONFAULTHANDLER):
its dump on its stderr, the line bare.
Also through `launch` (phalanx train's launcher, and phalanx.launch)."""

from __future__ import annotations

import ctypes
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx.runtime.devices import parse_devices
from phalanx.runtime.launch import LaunchSpec, launch
from phalanx.runtime.worker_errors import WorkerFailed

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parent / "scripts" / "crashes.py"


def _line_of(marker: str) -> int:
    return next(n for n, line in enumerate(SCRIPT.read_text().splitlines(), 1) if line.endswith(f"# {marker}"))


def _run(mode: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", "--threads-per-device", "1",
                           "--timeout", "30", str(SCRIPT), mode], capture_output=True, text=True, timeout=120,
                          cwd=SCRIPT.parent, env={**os.environ, **env})


@pytest.mark.parametrize("mode, signal_name, where", [
    ("segfault", "SIGSEGV", f"at crashes.py:{_line_of('segfault')}, in ctypes/__init__.py:\\d+ \\(string_at\\)"),
    ("thread", "SIGSEGV", f"at crashes.py:{_line_of('segfault')}, in ctypes/__init__.py:\\d+ \\(string_at\\)"),
    ("abort", "SIGABRT", f"at crashes.py:{_line_of('abort')} \\(crash\\)")])
def test_a_crash_names_the_scripts_line_and_the_rank_shows_its_python_stack(mode, signal_name, where):
    done = _run(mode)
    assert done.returncode != 0
    lines = done.stderr.splitlines()
    failed = next(line for line in lines if "worker rank" in line)
    assert re.fullmatch(f"phalanx: worker rank 1 failed: died \\(signal {signal_name}\\) {where}", failed), failed
    assert "Fatal Python error" not in done.stderr  # the dump went to the rank's file, not the terminal
    stack = lines[lines.index("--- rank 1 ---") + 1:]
    assert stack[0] == "Python's stack when it died (faulthandler's, most recent call last):"
    assert f'  File "{SCRIPT}", line {_line_of("abort" if mode == "abort" else "segfault")}' in "\n".join(stack)
    if mode != "thread":  # a thread's stack starts in threading; the main thread's at the script's top
        assert stack[1] == f'  File "{SCRIPT}", line {_line_of("rank 1")}, in <module>'


@pytest.mark.parametrize("mode, env", [("own", {}), ("segfault", {"PYTHONFAULTHANDLER": "1"})])
def test_a_script_that_enables_faulthandler_itself_keeps_its_dump_and_the_line_is_bare(mode, env):
    done = _run(mode, **env)
    assert done.returncode != 0
    assert "phalanx: worker rank 1 failed: died (signal SIGSEGV)\n" in done.stderr
    assert "Fatal Python error: Segmentation fault" in done.stderr  # the script's own handler wrote it


def crash_on_rank_one(world) -> int:
    if world.rank == 1:
        ctypes.string_at(0)
    return world.rank


def test_a_crash_in_a_launched_function_names_its_line():
    spec = LaunchSpec(plan=parse_devices("cpu:2", cuda_count=0), threads_per_device=1, timeout_s=30.0)
    with pytest.raises(WorkerFailed) as failed:
        launch(crash_on_rank_one, spec=spec)
    first = str(failed.value).splitlines()[0]
    line = crash_on_rank_one.__code__.co_firstlineno + 2
    assert re.fullmatch(f"worker rank 1 failed: died \\(signal SIGSEGV\\) at .*test_crash_site.py:{line}, "
                        "in ctypes/__init__.py:\\d+ \\(string_at\\)", first), first


HANGS = Path(__file__).resolve().parent / "scripts" / "hangs.py"


@pytest.mark.parametrize("group", ["phalanx", "torch"])
def test_a_rank_busy_elsewhere_is_named_with_the_line_it_was_at(group):
    done = subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", "--threads-per-device", "1",
                           "--timeout", "4", str(HANGS), group], capture_output=True, text=True, timeout=120,
                          cwd=HANGS.parent, env=dict(os.environ))
    assert done.returncode == 1, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    at = lines.index(next(line for line in lines if line.startswith("rank 1 had not reported")))
    source = HANGS.read_text().splitlines()
    sleeping, called = (next(n for n, line in enumerate(source, 1) if line.endswith(f"# {mark}"))
                        for mark in ("sleeping", "rank 1"))
    said = f"rank 1 had not reported when the run stopped: it was at hangs.py:{sleeping} (slow_data)"
    assert lines[at:at + 3] == [said,
                                f'  File "{HANGS}", line {called}, in <module>',
                                f'  File "{HANGS}", line {sleeping}, in slow_data'], done.stderr
    assert lines[at - 1].startswith("phalanx: run stopped: ")  # the line that says why comes first, as before


def _source_line(mark: str) -> int:
    return next(n for n, line in enumerate(HANGS.read_text().splitlines(), 1) if line.endswith(f"# {mark}"))


@pytest.mark.parametrize("group", ["phalanx", "torch"])
def test_ctrl_c_on_a_run_that_seems_stuck_says_where_each_rank_was(group):
    run = subprocess.Popen([sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", "--threads-per-device", "1",
                            "--timeout", "120", str(HANGS), group], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           bufsize=0, cwd=HANGS.parent, env=dict(os.environ))
    try:
        out, give_up_at = b"", time.monotonic() + 90
        while out.count(b" ready\n") < 2 and time.monotonic() < give_up_at:
            if select.select([run.stdout], [], [], 1.0)[0]:
                out += os.read(run.stdout.fileno(), 4096)
        assert sorted(out.decode().splitlines()) == ["rank 0 ready", "rank 1 ready"], out
        time.sleep(0.5)  # rank 0 into its barrier, rank 1 into its sleep
        run.send_signal(signal.SIGINT)  # as a terminal's Ctrl-C reaches the launcher
        err = run.communicate(timeout=60)[1].decode()
    finally:
        run.kill()
    assert run.returncode == 130, err
    lines = err.splitlines()
    at = lines.index("phalanx: interrupted; where each rank was:")
    assert lines[at + 1].startswith("rank 0 at hangs.py:"), err  # in its barrier, past the lambda that calls it
    assert lines[at + 2] == f"rank 1 at hangs.py:{_source_line('sleeping')} (slow_data)", err
