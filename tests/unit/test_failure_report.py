"""What the launcher prints when a run fails: the failing rank's traceback,
from the user's code down (not the launcher's frames above it); one line, "stopped too", for each
rank that only stopped because of it - a peer-died or abort error of phalanx's own, or gloo's lost
connection - and one line, "failed too", for a rank that failed on its own with the same error; a
rank that failed otherwise keeps its traceback. An echo never passes for the cause, even when it
arrives first. What a worker recorded in its TORCHELASTIC_ERROR_FILE (torch's @record) completes
a report that lacks it."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from phalanx.runtime import worker_errors
from phalanx.runtime.worker_errors import is_echo, recorded
from phalanx.runtime.main_module import Target, run_as_main

ROOT_TB = "Traceback (most recent call last):\n  File \"train.py\", line 9\nValueError: bad batch\n"
ECHO_TB = "Traceback (most recent call last):\n  File \"torch/distributed/...\"\nRuntimeError: Connection closed\n"


def _message(reports: dict, first: int) -> list[str]:
    return str(worker_errors.failure(reports, first, None)).splitlines()


def test_the_failing_ranks_traceback_and_one_line_per_echo():
    reports = {1: worker_errors.error_report("ValueError: bad batch", ROOT_TB),
               0: worker_errors.error_report("RuntimeError: Connection closed", ECHO_TB, echo=True),
               2: ("ok", None)}
    assert _message(reports, 1) == ["worker rank 1 failed: ValueError: bad batch", "--- rank 1 ---",
                                    *ROOT_TB.rstrip().splitlines(), "rank 0 stopped too: RuntimeError: Connection closed"]


def test_an_echo_that_arrives_first_is_not_taken_for_the_cause():
    reports = {0: worker_errors.error_report("PeerGone: rank 1 failed while rank 0 waited", ECHO_TB, echo=True),
               1: worker_errors.error_report("ValueError: bad batch", ROOT_TB)}
    lines = _message(reports, 0)
    assert lines[0] == "worker rank 1 failed: ValueError: bad batch"
    assert lines[-1] == "rank 0 stopped too: PeerGone: rank 1 failed while rank 0 waited"


def test_the_same_error_on_every_rank_is_one_traceback_and_each_rank_failed_too():
    reports = {r: worker_errors.error_report("ValueError: bad batch", ROOT_TB) for r in range(3)}
    lines = _message(reports, 0)
    assert sum(line.startswith("Traceback") for line in lines) == 1
    # Each raised it on its own: not "stopped too", which says a rank stopped because another failed.
    assert lines[-2:] == ["rank 1 failed too: ValueError: bad batch", "rank 2 failed too: ValueError: bad batch"]


def test_a_rank_that_failed_on_its_own_keeps_its_traceback():
    reports = {0: worker_errors.error_report("ValueError: bad batch", ROOT_TB),
               1: worker_errors.error_report("died (signal SIGKILL)")}
    message = "\n".join(_message(reports, 0))
    assert message.startswith("worker rank 1 failed: died (signal SIGKILL)\n--- rank 0 ---\n")  # the death once
    assert "--- rank 0 ---\n" + ROOT_TB.rstrip() in message


def test_only_an_error_that_a_peers_failure_caused_is_an_echo():
    from phalanx.comm.async_ops import CollectiveAborted
    from phalanx.comm.shm import ShmError, ShmPeerGone
    from phalanx.comm.watchdog import PeerGone

    for echo in (PeerGone("rank 1 died while rank 0 waited"), CollectiveAborted("not run"),
                 ShmPeerGone("shm allreduce: rank 1 (pid 9) died while rank 0 waited for it"),
                 RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"),
                 RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Read error: Connection reset by peer")):
        assert is_echo(echo), echo
    with pytest.raises(ValueError) as inside:
        dist.all_reduce(torch.ones(1))  # raised in torch.distributed, but about this rank's own call
    for own in (inside.value, ValueError("the user's own"), ShmError("cannot create the segment"),
                ConnectionResetError(104, "Connection reset by peer")):  # the script's own socket
        assert not is_echo(own), own


def test_what_a_worker_recorded_completes_a_report_that_lacks_it(tmp_path):
    record = tmp_path / "error.json"
    record.write_text(json.dumps({"message": {"message": "ValueError: bad batch",
                                              "extraInfo": {"py_callstack": ROOT_TB, "timestamp": "1"}}}))
    found = recorded(str(record))
    assert found == ("ValueError: bad batch", ROOT_TB)
    died = worker_errors.with_recorded(worker_errors.error_report("exited with code 1 without a result"), found)
    assert died == ("error", "exited with code 1 without a result: ValueError: bad batch", ROOT_TB, False)
    exited = worker_errors.with_recorded(("failed", "train.py exited with code 1 on rank 0", "", None, False), found)
    assert exited[1] == "train.py exited with code 1 on rank 0: ValueError: bad batch"
    same = worker_errors.error_report("ValueError: bad batch", "Traceback ...")  # phalanx saw it itself: nothing to add
    assert worker_errors.with_recorded(same, found) == same
    record.write_text(json.dumps({"message": "RuntimeError: plain", "timestamp": 1}))  # the plain-string form
    assert recorded(str(record)) == ("RuntimeError: plain", "")
    record.write_text("{not json")
    assert recorded(str(record)) is None and recorded(str(tmp_path / "none.json")) is None


def test_the_traceback_starts_at_the_users_code(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("def step():\n    raise ValueError('bad batch')\n\nstep()\n")
    with pytest.raises(ValueError) as failure:
        run_as_main(Target(str(script)), (), rank=0)
    exc = failure.value.with_traceback(failure.value.__traceback__.tb_next)  # from run_as_main's frame down
    lines = worker_errors.user_traceback(exc).splitlines()
    assert lines[:2] == ["Traceback (most recent call last):", f'  File "{script}", line 4, in <module>']
    assert lines[-1] == "ValueError: bad batch" and "runpy" not in "\n".join(lines)


def test_a_start_up_wait_that_ran_out_for_a_stopped_worker_names_that_worker(monkeypatch):
    """SIGSTOP on rank 1 in its first second: rank 0's rendezvous wait ran out and it was blamed,
    under a DistStoreError traceback (an outside operator's trial). The stopped worker is the cause."""
    from phalanx.runtime import worker_errors
    from phalanx.runtime.worker_errors import blame_stopped, error_report, failure

    states = {101: "S", 102: "T"}
    monkeypatch.setattr(worker_errors, "process_state", lambda pid: states.get(pid))
    store = "DistStoreError: wait timeout after 10000ms, keys: /phalanx/x/0//cpu//0/1"
    reports = {0: error_report(store, "Traceback ...\n")}
    rank = blame_stopped(reports, 0, {1: 102})
    text = str(failure(reports, rank, None))
    assert text == ("worker rank 1 failed: stopped responding (state: stopped) during start-up, while rank 0 waited "
                    f"for it (SIGSTOP, Ctrl-Z or a debugger?)\nrank 0 stopped too: {store}")
    other = {0: error_report("ValueError: bad shape", "Traceback ...\n")}  # not a wait that ran out: as it was
    assert blame_stopped(other, 0, {1: 102}) == 0 and other[0][3] is False
    running = {0: error_report(store, "")}  # the peer runs: no one to blame but the waiter's own line
    assert blame_stopped(running, 0, {1: 101}) == 0


def test_a_rank_that_exited_0_while_its_peers_waited_is_the_rank_at_fault():
    # phalanx run counts an exit 0 without a result as success (torchrun's rule); but when the
    # only failures are echoes of its going, it is the cause, not the rank that waited for it.
    reports = {0: worker_errors.error_report("ShmPeerGone: rank 1 (pid 9) died while rank 0 waited for it",
                                             ECHO_TB, echo=True),
               1: worker_errors.LEFT_EARLY}
    error = worker_errors.failure(reports, 0, [20, 14])
    lines = str(error).splitlines()
    assert lines[0].startswith("worker rank 1 failed: exited (code 0) without finishing its part after step 14 "
                               "while rank 0 waits for it in a collective; "), lines
    assert lines[1:] == ["rank 0 stopped too: ShmPeerGone: rank 1 (pid 9) died while rank 0 waited for it"]
    assert error.rank == 1 and not error.restartable  # it would exit again: as sys.exit(0) mid-run


def test_a_rank_that_exited_0_is_no_cause_beside_a_rank_that_failed_on_its_own():
    reports = {0: worker_errors.error_report("ValueError: bad batch", ROOT_TB), 1: worker_errors.LEFT_EARLY}
    assert _message(reports, 0)[0] == "worker rank 0 failed: ValueError: bad batch"


def _refused_here():
    from phalanx.runtime.devices import parse_devices

    parse_devices("cpu:0", cuda_count=0)  # phalanx refuses it: the line below this file's call names it


def test_a_refused_call_is_led_by_the_users_file_and_line_not_phalanx_s():
    from phalanx.errors import UsageError

    with pytest.raises(UsageError) as refused:
        _refused_here()
    line = _refused_here.__code__.co_firstlineno + 3
    shown = os.path.relpath(__file__)  # from where the tests run; the whole path from outside the tree
    shown = __file__ if shown.startswith("..") else shown
    assert worker_errors.usage_line(refused.value) == f"{shown}:{line}: {refused.value}"
    refused.value.__traceback__ = refused.value.__traceback__.tb_next.tb_next  # phalanx's frames alone
    assert worker_errors.usage_line(refused.value) == str(refused.value)  # phalanx train's own: the flag names it


def test_a_usage_error_the_users_code_raises_itself_keeps_its_own_words():
    from phalanx.errors import UsageError

    def own_check():
        raise UsageError("--lr must be positive; pass --lr 0.1")

    with pytest.raises(UsageError) as refused:
        own_check()
    assert worker_errors.usage_line(refused.value) == "--lr must be positive; pass --lr 0.1"
