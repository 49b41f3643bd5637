"""The launcher's stop handlers in one process: the first SIGTERM raises `Stopped`, a second one
while stopping is absorbed (a scheduler that escalates cannot cut the clean-up short), a block
that must not be torn (clean-up, starting a worker) holds the stop until it ends, and the
handlers a library caller had are back afterwards."""

import os
import signal
import time

import pytest

from phalanx.errors import Stopped
from phalanx.runtime.lifeline import signals_deferred, stop_on_signals


def _signal_self(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(0.2)  # the Python-level handler runs at the next bytecode boundary; this is ample


def test_the_first_stop_raises_and_a_second_is_absorbed():
    before = signal.getsignal(signal.SIGTERM)
    with stop_on_signals():
        with pytest.raises(Stopped) as stopped:
            _signal_self(signal.SIGTERM)
        assert (stopped.value.signum, stopped.value.exit_code) == (signal.SIGTERM, 143)
        _signal_self(signal.SIGTERM)  # while stopping: absorbed, nothing raised, the process lives
        _signal_self(signal.SIGHUP)
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_deferred_block_finishes_before_the_stop_is_raised():
    finished = False
    with stop_on_signals():
        with pytest.raises(Stopped):
            with signals_deferred():
                _signal_self(signal.SIGTERM)
                finished = True
    assert finished


def test_each_launch_starts_with_no_stop_pending():
    with stop_on_signals():
        with pytest.raises(Stopped):
            _signal_self(signal.SIGHUP)
    with stop_on_signals():  # a later launch in the same process is not already "stopping"
        with pytest.raises(Stopped) as stopped:
            _signal_self(signal.SIGTERM)
    assert stopped.value.signum == signal.SIGTERM
