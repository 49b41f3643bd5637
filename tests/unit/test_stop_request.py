"""A stop that keeps the work, in one process: while armed, the first SIGTERM is a request (the
process lives, its output flushed), a second does what the replaced handler did; the ranks'
sum decides for all; the after-step hook saves the agreed step, then raises `Stopped` naming it;
the launcher's reports of such a stop make one `Stopped`, and its line names where to resume."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from phalanx.errors import Stopped
from phalanx.job.checkpointing import CheckpointConfig
from phalanx.job.config import TrainConfig
from phalanx.job.optim import OptimizerConfig
from phalanx.job.step_hook import after_step_hook
from phalanx.train.stopping import StopCheck, stop_check
from phalanx.runtime import stop_request
from phalanx.runtime.lifeline import stop_message
from phalanx.runtime.worker_errors import WorkerFailed, error_report, failure
from phalanx.runtime.world import World

WORLD1 = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), backend="none",
               timeout_s=10.0)


class Replaced(Exception):
    """What the handler armed() replaced raises: the launcher's Stopped, in the real thing."""


def _sigterm_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)  # the Python-level handler runs at the next bytecode boundary; this is ample


def _replaced(signum, frame):
    raise Replaced(signum)


@pytest.fixture
def replaced_handler():
    before = signal.signal(signal.SIGTERM, _replaced)
    yield
    signal.signal(signal.SIGTERM, before)


def test_armed_the_first_sigterm_is_a_request_and_the_second_what_was_there(replaced_handler):
    with stop_request.armed() as armed:
        assert armed and stop_request.requested() is None and not stop_request.agreed(None)
        _sigterm_self()  # unarmed, this raised Replaced
        assert stop_request.requested() == signal.SIGTERM and stop_request.agreed(None)
        with pytest.raises(Replaced):
            _sigterm_self()
    assert signal.getsignal(signal.SIGTERM) is _replaced  # given back
    with pytest.raises(Replaced):
        _sigterm_self()


def test_not_armed_when_disabled_nested_or_off_the_main_thread(replaced_handler):
    with stop_request.armed(enabled=False) as armed:
        assert not armed and signal.getsignal(signal.SIGTERM) is _replaced
    with stop_request.armed() as outer, stop_request.armed() as inner:
        assert outer and not inner
    assert signal.getsignal(signal.SIGTERM) is _replaced  # the inner one gave back nothing of its own
    seen = []

    def off_main():
        with stop_request.armed() as armed:
            seen.append(armed)

    thread = threading.Thread(target=off_main)
    thread.start()
    thread.join()
    assert seen == [False]


def test_a_new_arming_starts_with_no_request_pending(replaced_handler):
    with stop_request.armed():
        _sigterm_self()
    with stop_request.armed():
        assert stop_request.requested() is None


def test_any_rank_asked_stops_every_rank():
    peers_asked = [0.0]  # the other ranks' share of the sum

    def sum_over_ranks(values):
        return [values[0] + peers_asked[0]]

    assert not stop_request.agreed(sum_over_ranks)  # nobody asked (no request pending outside armed)
    peers_asked[0] = 1.0
    assert stop_request.agreed(sum_over_ranks)  # a peer was: this rank stops after the same step


def _hook(tmp_path, stop, **config):
    param = torch.nn.Parameter(torch.zeros(2))
    saved = []
    config = TrainConfig(optim=OptimizerConfig(lr=0.2), out_dir=str(tmp_path), **config)
    hook = after_step_hook(config=config, world=WORLD1, optimizer=torch.optim.SGD([param], lr=0.2), epoch=1,
                           warmup=0, gradients=lambda: {}, save=saved.append, stop=stop)
    return hook, saved


def test_the_hook_saves_the_agreed_step_then_raises_stopped_naming_it(tmp_path):
    sums = []

    def sum_over_ranks(values):
        sums.append(list(values))
        return [1.0]  # a peer was asked

    stop = StopCheck(every_steps=2, sum_over_ranks=sum_over_ranks, saved_in=str(tmp_path / "checkpoints"))
    hook, saved = _hook(tmp_path, stop)
    hook(1, 4, torch.tensor(1.0), lambda: [1.0, 2.0])  # global step 5: not a stop-check step
    assert saved == [] and sums == []
    with pytest.raises(Stopped) as stopped:
        hook(2, 4, torch.tensor(1.0), lambda: [1.0, 2.0])
    assert [(p.epoch, p.step, p.epoch_totals) for p in saved] == [(1, 2, (1.0, 2.0))]
    assert sums == [[0.0]]  # the question (the save itself waits for rank 0's write)
    line, code = stop_message(stopped.value)
    assert code == 143
    assert line == (f"phalanx: stopped by SIGTERM after epoch 2, step 2 of 4, saved in {tmp_path}/checkpoints; "
                    "run the same command with --resume auto to continue")


def test_a_stop_after_a_periodic_checkpoint_saves_once_and_an_epochs_last_step_is_saved(tmp_path):
    stop = StopCheck(every_steps=1, sum_over_ranks=lambda values: [1.0], saved_in="ckpt")
    hook, saved = _hook(tmp_path, stop, checkpoint=CheckpointConfig(every="2"))
    with pytest.raises(Stopped):
        hook(2, 4, torch.tensor(1.0), lambda: [1.0])
    assert [(p.epoch, p.step) for p in saved] == [(1, 2)]
    hook, saved = _hook(tmp_path, stop)
    with pytest.raises(Stopped):
        hook(4, 4, torch.tensor(1.0), lambda: [1.0])
    assert [(p.epoch, p.step) for p in saved] == [(1, 4)]  # a resume skips its steps and evaluates it


def test_where_and_how_often_the_ranks_ask():
    assert stop_check(WORLD1, saved_in=None, check_every=100) is None  # nowhere to save: not armed either
    alone = stop_check(WORLD1, saved_in="ckpt", check_every=100)
    assert (alone.every_steps, alone.sum_over_ranks) == (1, None)  # a CPU asks every step
    gpu = World(rank=0, world_size=2, local_rank=0, local_world_size=2, device=torch.device("cuda", 0),
                backend="nccl", timeout_s=10.0)
    assert stop_check(gpu, saved_in="ckpt", check_every=50).every_steps == 50  # where the device is read anyway
    assert stop_check(gpu, saved_in="ckpt", check_every=0).every_steps == 100
    hosts = World(rank=0, world_size=4, local_rank=0, local_world_size=2, device=torch.device("cpu"), backend="gloo",
                  timeout_s=10.0)
    assert stop_check(hosts, saved_in="ckpt", check_every=50).every_steps == 50  # across a network: not every step


def test_reports_of_a_stop_make_one_stopped_and_an_error_beside_it_wins():
    detail = "after epoch 2, step 3 of 6, saved in r/checkpoints; run the same command with --resume auto to continue"
    stopped = {0: ("stopped", signal.SIGTERM, detail), 1: ("stopped", signal.SIGTERM, detail)}
    exc = failure(stopped, 1, None)
    assert isinstance(exc, Stopped) and exc.detail == detail and exc.exit_code == 143
    mixed = {0: ("stopped", signal.SIGTERM, detail), 1: error_report("OSError: disk full")}
    exc = failure(mixed, 0, None)
    assert isinstance(exc, WorkerFailed) and str(exc).startswith("worker rank 1 failed: OSError: disk full")
    assert stop_message(Stopped(signal.SIGTERM)) == ("phalanx: stopped by SIGTERM; every worker was stopped", 143)


def test_a_scripts_first_question_arms_the_process_for_good(replaced_handler):
    import phalanx
    from phalanx.data_parallel import DataParallel

    dp = DataParallel(torch.nn.Linear(2, 1), world=WORLD1)
    try:
        assert not phalanx.stop_requested(dp)  # armed from here on: SIGTERM is a request
        _sigterm_self()
        assert phalanx.stop_requested(dp) and phalanx.stop_requested(dp)
        with pytest.raises(Replaced):
            _sigterm_self()  # a second one: what was there
    finally:
        signal.signal(signal.SIGTERM, _replaced)
        stop_request._REQUEST.signum, stop_request._REQUEST.previous = None, {}
        dp.close()
    seen = []
    thread = threading.Thread(target=lambda: seen.append(phalanx.stop_requested(dp)))
    with pytest.warns(phalanx.PhalanxWarning, match="main thread only"):
        thread.start()
        thread.join()
    assert seen == [False]
