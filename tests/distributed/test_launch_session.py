"""phalanx.launch called again and again from one long-lived process, as a notebook's kernel calls it.

A failed or interrupted launch whose exception the session keeps (IPython keeps the last
traceback) holds none of its workers' descriptors: before, each such launch kept 2 pipes per
worker open for as long as its traceback lived. The exception is raised from the launch call
(the supervisor's frames are cut), and a worker's line names launch's keyword, `timeout_s`, not
`phalanx run`'s `--timeout`."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
import traceback
from pathlib import Path

import pytest

import phalanx
from phalanx.runtime.worker_errors import WorkerFailed

pytestmark = pytest.mark.distributed


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


def _rank_1_never_comes() -> None:
    world = phalanx.init()
    if world.rank == 0:
        phalanx.barrier(world=world)
    else:
        time.sleep(60)


def _interrupt_once(marker: Path) -> None:
    """SIGINT to this process once `marker` exists (the workers are running), as Jupyter's interrupt."""
    give_up_at = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < give_up_at:
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


def test_a_failure_is_raised_from_the_launch_call_naming_its_keyword():
    with pytest.raises(WorkerFailed) as caught:
        phalanx.launch(_rank_1_never_comes, devices="cpu:2", timeout_s=3, quiet=True)
    text = str(caught.value)
    assert "past the 3 s timeout" in text and "raise timeout_s" in text and "--timeout" not in text, text
    files = [Path(frame.filename).name for frame in traceback.extract_tb(caught.value.__traceback__)]
    assert files == [Path(__file__).name, "function_launch.py"], files

