"""Which launch failures `--max-restarts` restarts, read from the failure's fields, not its text."""

from phalanx.comm.watchdog import CollectiveMismatch, PeerStalled
from phalanx.errors import RunFailed
from phalanx.runtime.worker_errors import WorkerFailed
from phalanx.runtime.restarts import failure_of

NAMES = ("cpu:0", "cpu:1", "cpu:2")


def test_a_dead_worker_is_blamed_and_restartable():
    exc = WorkerFailed("worker rank 2 failed: died (signal SIGKILL) after step 31\n--- rank 2 ---\n...", rank=2,
                       restartable=True)
    failure = failure_of(exc, NAMES)
    assert (failure.rank, failure.device, failure.what) == (2, "cpu:2", "died (signal SIGKILL) after step 31")


def test_a_lost_loader_worker_is_blamed_on_its_rank_and_restartable():
    exc = WorkerFailed("run stopped: rank 1's DataLoader worker (pid 4242) exited with code 3 after step 7: its "
                       "dataset's code ...", rank=1, restartable=True)
    failure = failure_of(exc, NAMES)
    assert (failure.rank, failure.device) == (1, "cpu:1")
    assert failure.what == ("lost its DataLoader worker (pid 4242), which exited with code 3 after step 7: its "
                            "dataset's code ...")


def test_a_worker_that_stopped_responding_is_blamed_by_the_watchdog_and_restartable():
    assert PeerStalled.restartable and not RunFailed.restartable and not CollectiveMismatch.restartable
    stalled = PeerStalled("worker rank 1 stopped responding (state: stopped) after step 9; rank 0 waited 5 s in step "
                          "10's gradient bucket 2 (98.6 KiB)", culprit=1)
    exc = WorkerFailed(f"run stopped: {stalled}", rank=stalled.culprit, restartable=stalled.restartable)
    failure = failure_of(exc, NAMES)
    assert (failure.rank, failure.device) == (1, "cpu:1")
    assert failure.what.startswith("stopped responding (state: stopped) after step 9; rank 0 waited 5 s")


def test_conditions_that_would_repeat_are_not_restarted():
    assert failure_of(WorkerFailed("run stopped: loss is nan at step 3 on rank 1; lower --lr"), NAMES) is None
    mismatch = CollectiveMismatch("ranks are in different collectives: ...")
    assert failure_of(WorkerFailed(f"run stopped: {mismatch}", rank=mismatch.culprit,
                                   restartable=mismatch.restartable), NAMES) is None
    # A stall with no rank to blame (every rank entered; the collective never completed) restarts nothing either.
    assert failure_of(WorkerFailed("run stopped: rank 0 waited 5 s ...", rank=None, restartable=True), NAMES) is None
