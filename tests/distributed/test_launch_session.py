"""phalanx.launch called again and again from one long-lived process, as a notebook's kernel calls it.

A failed or interrupted launch whose exception the session keeps (IPython keeps the last
traceback) holds none of its workers' descriptors: before, each such launch kept 2 pipes per
worker open for as long as its traceback lived. The exception is raised from the launch call
(the supervisor's frames are cut), and a worker's line names launch's keyword, `timeout_s`, not
`phalanx run`'s `--timeout`. A Ctrl-C reaches the function's own `except KeyboardInterrupt:` in
each worker (an emergency save), as under `phalanx run`; before, the workers were ended without
it. A result pickle cannot take is named as the result, not as the function's failure with a
traceback into the supervisor. The modules the public API loads on first use and torch's
compiler front end (which a process's first torch.optim optimizer imports) are imported once in
the launching process, so each worker of each launch finds them imported: before, every worker
of every launch imported them anew (~3 s of a 4-step launch on 2 cores). A Ctrl-C that lands
during those imports waits for them to be whole: cut short, they left half-made modules that
failed every later launch of the session."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from pathlib import Path

import pytest

import phalanx
from phalanx.runtime.worker_errors import WorkerFailed

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rank() -> int:
    return phalanx.init().rank


def _fail_on_rank_1() -> None:
    world = phalanx.init()
    if world.rank == 1:
        raise ValueError("rank 1's own failure")
    phalanx.barrier(world=world)


def _spin(marker: str) -> None:
    world = phalanx.init()
    if world.rank == 0:
        Path(marker).touch()
    while True:
        phalanx.barrier(world=world)


def _save_on_interrupt(marker: str, saved: str) -> None:
    world = phalanx.init()
    try:
        Path(f"{marker}.{world.rank}").touch()
        while True:  # a step's Python between its C calls, where the interrupt lands
            time.sleep(0.05)
    except KeyboardInterrupt:  # a script's emergency save, as under phalanx run
        Path(f"{saved}.{world.rank}").write_text("saved")
        raise


def _rank_1_never_comes() -> None:
    world = phalanx.init()
    if world.rank == 0:
        phalanx.barrier(world=world)
    else:
        time.sleep(60)


def _interrupt_once(*markers: Path) -> None:
    """SIGINT to this process once `markers` exist (the workers are running), as Jupyter's interrupt."""
    give_up_at = time.monotonic() + 60
    while not all(marker.exists() for marker in markers) and time.monotonic() < give_up_at:
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors through /proc")
def test_kept_failures_and_interrupts_hold_no_descriptors(tmp_path):
    assert phalanx.launch(_rank, devices="cpu:2", timeout_s=60, quiet=True) == [0, 1]  # what lasts is made
    gc.collect()
    before = _open_descriptors()
    kept = []
    for _ in range(2):
        with pytest.raises(WorkerFailed) as caught:
            phalanx.launch(_fail_on_rank_1, devices="cpu:2", timeout_s=60, quiet=True)
        kept.append(caught.value)
    marker = tmp_path / "running"
    interrupter = threading.Thread(target=_interrupt_once, args=(marker,))
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt) as caught:
            phalanx.launch(_spin, str(marker), devices="cpu:2", timeout_s=60, quiet=True)
    finally:
        interrupter.join()
    kept.append(caught.value)
    gc.collect()
    assert _open_descriptors() == before, [type(exc).__name__ for exc in kept]
    assert phalanx.launch(_rank, devices="cpu:2", timeout_s=60, quiet=True) == [0, 1]  # and the next one runs


def test_an_interrupt_reaches_the_functions_own_handler_in_each_worker(tmp_path):
    marker, saved = tmp_path / "running", tmp_path / "saved"
    interrupter = threading.Thread(target=_interrupt_once, args=(tmp_path / "running.1", tmp_path / "running.0"))
    interrupter.start()
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            phalanx.launch(_save_on_interrupt, str(marker), str(saved), devices="cpu:2", timeout_s=60, quiet=True)
    finally:
        interrupter.join()
    assert sorted(path.name for path in tmp_path.glob("saved.*")) == ["saved.0", "saved.1"]
    assert time.monotonic() - started < 30


def test_a_failure_is_raised_from_the_launch_call_naming_its_keyword():
    with pytest.raises(WorkerFailed) as caught:
        phalanx.launch(_rank_1_never_comes, devices="cpu:2", timeout_s=3, quiet=True)
    text = str(caught.value)
    assert "past the 3 s timeout" in text and "raise timeout_s" in text and "--timeout" not in text, text
    files = [Path(frame.filename).name for frame in traceback.extract_tb(caught.value.__traceback__)]
    assert files == [Path(__file__).name, "function_launch.py"], files


def _a_lock() -> threading.Lock:
    phalanx.init()
    return threading.Lock()


def test_a_result_pickle_cannot_take_is_named_as_the_result():
    with pytest.raises(WorkerFailed) as caught:
        phalanx.launch(_a_lock, devices="cpu:2", timeout_s=60, quiet=True)
    lines = str(caught.value).splitlines()
    assert lines[0] == ("worker rank 0 failed: TypeError: the result it returned cannot be sent back (cannot pickle "
                        "'_thread.lock' object); return tensors, numbers, strings, or lists, tuples and dicts of "
                        "them"), lines
    assert lines[1:] == ["rank 1 failed too: " + lines[0].removeprefix("worker rank 0 failed: ")], lines


PROBE = textwrap.dedent("""\
    import sys
    import phalanx

    def probe():
        wanted = ("phalanx.data_parallel.prepare", "phalanx.train.sharded_loader", "phalanx.train.evaluate",
                  "torch._dynamo")
        return [name for name in wanted if name not in sys.modules]

    print("missing in the workers:", phalanx.launch(probe, devices="cpu:2", quiet=True), flush=True)
""")


def test_the_workers_find_the_api_and_torchs_compiler_imported():
    proc = subprocess.run([sys.executable, "-"], input=PROBE, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "missing in the workers: [[], []]" in proc.stdout, proc.stdout + proc.stderr[-2000:]


INTERRUPTED_IMPORT = textwrap.dedent("""\
    import os, signal, sys, threading, time
    import torch
    import phalanx

    def interrupt_mid_import():                      # Jupyter's interrupt, while launch imports sympy
        while "sympy.printing" not in sys.modules:
            time.sleep(0.0005)
        os.kill(os.getpid(), signal.SIGINT)

    if "sympy.printing" in sys.modules:
        print("sympy came with torch", flush=True)
        sys.exit(0)
    threading.Thread(target=interrupt_mid_import, daemon=True).start()
    try:
        phalanx.launch(lambda: 0, devices="cpu:2", quiet=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    print("the next launch:", phalanx.launch(lambda: phalanx.init().rank, devices="cpu:2", quiet=True), flush=True)
""")


def test_an_interrupt_during_the_imports_leaves_the_session_working():
    proc = subprocess.run([sys.executable, "-"], input=INTERRUPTED_IMPORT, capture_output=True, text=True,
                          timeout=180, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    if "sympy came with torch" in proc.stdout:
        pytest.skip("this torch imports sympy itself: launch imports none of it")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["interrupted", "the next launch: [0, 1]"], proc.stdout + proc.stderr[-2000:]
