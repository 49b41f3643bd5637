"""The watchdog's check (comm/watchdog.py) against real peer processes, on boards shared in this
process (tests/unit/test_board.py's): a peer whose process died and was reaped is named as died;
one SIGSTOPped keeps the wait going until the deadline, then is named with its state and the
collective it left rank 0 waiting in."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from phalanx.comm import PeerGone, PeerStalled
from phalanx.comm.watchdog import check
from phalanx.runtime.board import COMM, WORLD
from phalanx.runtime.procs import process_state
from phalanx.runtime.tags import Tag
from tests.unit.test_board import boards, world_of


@pytest.fixture
def stopped_process():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    child.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while process_state(child.pid) != "T":  # kill() returns before the child has acted on it
        assert time.monotonic() < deadline, "the child never stopped"
        time.sleep(0.01)
    yield child.pid
    child.kill()
    child.wait()


def test_a_dead_peer_is_named():
    child = subprocess.Popen(["true"])
    child.wait()  # reaped: its pid names no process
    a, _ = boards(2, pids=[None, child.pid])
    mine = a.enter(WORLD, Tag("metrics"), 8)
    with pytest.raises(PeerGone, match=f"rank 1 \\(pid {child.pid}\\) died while rank 0 waited for it in metrics"):
        check(world_of(a), mine, waited_s=0.5, timeout_s=60)


def test_at_the_deadline_the_stopped_peer_is_named(stopped_process):
    a, b = boards(2, pids=[None, stopped_process])
    for board in (a, b):  # 57 steps together, then rank 1 froze
        for step in range(57):
            for bucket in range(3):  # each bucket entered, then settled once it completed
                board.settled(board.enter(COMM, Tag("gradient", bucket, step=step), 64))
    mine = a.enter(COMM, Tag("gradient"), 64)
    check(world_of(a), mine, waited_s=19.5, timeout_s=20)  # before the deadline: keep waiting
    with pytest.raises(PeerStalled) as info:
        check(world_of(a), mine, waited_s=20.2, timeout_s=20)
    assert str(info.value).startswith("worker rank 1 stopped responding (state: stopped) after step 57; rank 0 waited "
                                      "20 s in step 58's gradient bucket 0 (64 B)")


def test_a_peer_stopped_inside_a_collective_its_peers_completed_is_named_stopped_not_mismatched(stopped_process):
    """shm: both ranks entered bucket 0 and rank 0 read the sum and went on to bucket 1, while rank 1
    was stopped before it saw the result; its board still says it waits in bucket 0. That is a stop,
    not two ranks calling collectives in different orders."""
    a, b = boards(2, pids=[None, stopped_process])
    theirs = b.enter(COMM, Tag("gradient", 0, step=6), 64)
    b.block(theirs)  # rank 1 waits in bucket 0 when SIGSTOP arrives
    a.settled(a.enter(COMM, Tag("gradient", 0, step=6), 64))
    mine = a.enter(COMM, Tag("gradient", 1, step=6), 128)
    with pytest.raises(PeerStalled) as info:
        check(world_of(a), mine, waited_s=5.2, timeout_s=5)
    assert str(info.value).startswith("worker rank 1 stopped responding (state: stopped)"), str(info.value)
