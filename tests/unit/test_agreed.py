"""comm/agreed.py in a world of one, and how another rank raises a failure it is told of: bad input
stays a UsageError, an OSError keeps its class and errno (a script's `except OSError:` catches it
on every rank), anything else a PeerLost naming the rank. The agreement across ranks is
tested under `phalanx run` (tests/distributed/test_agreed_failures.py)."""

from __future__ import annotations

import errno

import pytest
import torch

from phalanx.comm import Tag, agreed_outcome
from phalanx.comm.agreed import _telling, told_again
from phalanx.errors import PeerLost, UsageError, WriteFailed
from phalanx.runtime.world import World

WORLD1 = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), backend="none",
               timeout_s=10.0)


def test_a_failure_is_raised_again_after_undo_and_success_undoes_nothing():
    undone = []
    with pytest.raises(ZeroDivisionError):
        with agreed_outcome(WORLD1, Tag("checkpoint"), undo=lambda: undone.append(1)):
            1 / 0
    assert undone == [1]
    with agreed_outcome(WORLD1, Tag("checkpoint"), undo=lambda: undone.append(2)):
        pass
    assert undone == [1]


def test_a_stop_is_not_a_failure_to_agree_on():
    undone = []
    with pytest.raises(KeyboardInterrupt):
        with agreed_outcome(WORLD1, Tag("checkpoint"), undo=lambda: undone.append(1)):
            raise KeyboardInterrupt
    assert undone == []


def test_another_rank_raises_what_it_was_told_as_its_kind():
    full = WriteFailed.of("ck/checkpoint.pt", OSError(errno.ENOSPC, "No space left on device"))
    again = told_again(0, _telling(full))
    assert isinstance(again, OSError) and isinstance(again, WriteFailed)
    assert (str(again), again.errno, again.strerror) == (str(full), errno.ENOSPC, "No space left on device")
    refused = told_again(0, _telling(ConnectionRefusedError(111, "Connection refused")))
    assert type(refused) is ConnectionRefusedError and (refused.errno, str(refused)) == (111, "[Errno 111] Connection "
                                                                                          "refused")
    unpicklable = OSError("half")
    unpicklable.handle = lambda: None  # its __dict__ does not pickle: rebuilt as an OSError with the same line
    again = told_again(0, _telling(unpicklable))
    assert type(again) is OSError and str(again) == "half"
    bad = told_again(0, _telling(UsageError("ck is a file; pick another directory")))
    assert type(bad) is UsageError and str(bad) == "ck is a file; pick another directory"
    other = told_again(3, _telling(KeyError("model")))
    # An echo of rank 3's own report, whose traceback the launcher shows.
    assert type(other) is PeerLost and str(other) == "rank 3 failed: KeyError: 'model'"
