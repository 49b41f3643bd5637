"""What the launcher prints when a run fails (issue 28, item 10): the failing rank's traceback,
from the user's code down (not the launcher's frames above it), and one line for each rank that
only stopped because of it - its collective lost a peer - or repeats its error; a rank that
failed on its own keeps its traceback. A collective's echo never passes for the cause, even when
it arrives first."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from phalanx.runtime import supervise
from phalanx.runtime.script import script_worker

ROOT_TB = "Traceback (most recent call last):\n  File \"train.py\", line 9\nValueError: bad batch\n"
ECHO_TB = "Traceback (most recent call last):\n  File \"torch/distributed/...\"\nRuntimeError: Connection closed\n"


def _message(reports: dict, first: int) -> list[str]:
    return str(supervise._failure(reports, first, None)).splitlines()


def test_the_failing_ranks_traceback_and_one_line_per_echo():
    reports = {1: supervise._error("ValueError: bad batch", ROOT_TB),
               0: supervise._error("RuntimeError: Connection closed", ECHO_TB, echo=True),
               2: ("ok", None)}
    assert _message(reports, 1) == ["worker rank 1 failed: ValueError: bad batch", "--- rank 1 ---",
                                    *ROOT_TB.rstrip().splitlines(), "rank 0 stopped too: RuntimeError: Connection closed"]


def test_an_echo_that_arrives_first_is_not_taken_for_the_cause():
    reports = {0: supervise._error("PeerGone: rank 1 failed while rank 0 waited", ECHO_TB, echo=True),
               1: supervise._error("ValueError: bad batch", ROOT_TB)}
    lines = _message(reports, 0)
    assert lines[0] == "worker rank 1 failed: ValueError: bad batch"
    assert lines[-1] == "rank 0 stopped too: PeerGone: rank 1 failed while rank 0 waited"


def test_the_same_error_on_every_rank_is_one_traceback():
    reports = {r: supervise._error("ValueError: bad batch", ROOT_TB) for r in range(3)}
    lines = _message(reports, 0)
    assert sum(line.startswith("Traceback") for line in lines) == 1
    assert lines[-2:] == ["rank 1 stopped too: ValueError: bad batch", "rank 2 stopped too: ValueError: bad batch"]


def test_a_rank_that_failed_on_its_own_keeps_its_traceback():
    reports = {0: supervise._error("ValueError: bad batch", ROOT_TB),
               1: supervise._error("died (signal SIGKILL)")}
    message = "\n".join(_message(reports, 0))
    assert message.startswith("worker rank 1 failed: died (signal SIGKILL)\n--- rank 1 ---\ndied (signal SIGKILL)")
    assert "--- rank 0 ---\n" + ROOT_TB.rstrip() in message


def test_an_error_raised_inside_a_collective_is_an_echo():
    with pytest.raises(ValueError) as inside:
        dist.all_reduce(torch.ones(1))  # no process group: raised in torch.distributed
    assert supervise._from_a_collective(inside.value)
    with pytest.raises(ValueError) as outside:
        raise ValueError("the user's own")
    assert not supervise._from_a_collective(outside.value)


def test_the_traceback_starts_at_the_users_code(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("def step():\n    raise ValueError('bad batch')\n\nstep()\n")
    with pytest.raises(ValueError) as failure:
        script_worker(str(script), (), rank=0)
    exc = failure.value.with_traceback(failure.value.__traceback__.tb_next)  # from script_worker's frame down
    lines = supervise._traceback(exc).splitlines()
    assert lines[:2] == ["Traceback (most recent call last):", f'  File "{script}", line 4, in <module>']
    assert lines[-1] == "ValueError: bad batch" and "runpy" not in "\n".join(lines)
