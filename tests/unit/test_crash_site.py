"""A worker that died of a fatal signal is reported with where it was: the script's line and the
innermost frame, from the faulthandler dump the worker wrote into the file beside its error file,
and that stack as the rank's traceback (crash_site.py). Before, "died (signal SIGSEGV)" alone. A
crash in DDP's constructor while TORCH_DISTRIBUTED_DEBUG=DETAIL is set names the setting and its
fix. A rank that had not reported when the run failed is asked for its stack (a real-time signal
faulthandler answers), and named with the line its work was at. Here on dumps written as
faulthandler writes them, and on this process answering its own request;
tests/distributed/test_crash_site.py crashes and hangs real workers."""

from __future__ import annotations

import faulthandler
import os
import signal
import textwrap

import torch

from phalanx.runtime import worker_errors
from phalanx.runtime import crash_site as sites
from phalanx.runtime.crash_site import FAULT_FILE, STACK_FILE, STACK_SIGNAL, ask_where, crash_site, crashed_stack
from phalanx.runtime.procs import catches_signal

TORCH_DIR = os.path.dirname(torch.__file__)
DDP_FILE = os.path.join(TORCH_DIR, "nn", "parallel", "distributed.py")
RUNTIME = os.path.join(os.path.dirname(worker_errors.__file__), "supervise.py")
STDLIB = os.path.dirname(os.__file__)

# What Python 3.11-3.13 write for faulthandler.enable(all_threads=True): another thread listed
# before the one that crashed, then the crashed one, then the extension modules.
DUMP = textwrap.dedent(f"""\
    Fatal Python error: Segmentation fault

    Thread 0x00007f1e2a1fc6c0 (most recent call first):
      File "{STDLIB}/threading.py", line 331 in wait
      File "{STDLIB}/threading.py", line 1002 in _bootstrap

    Current thread 0x00007f1e3c9d7b80 (most recent call first):
      File "{DDP_FILE}", line 1473 in _ddp_init_helper
      File "{DDP_FILE}", line 1079 in __init__
      File "/home/user/project/train.py", line 41 in build
      File "/home/user/project/train.py", line 77 in <module>
      File "{RUNTIME}", line 139 in _report_then_teardown
      File "{STDLIB}/multiprocessing/process.py", line 108 in run
      File "<string>", line 1 in <module>

    Extension modules: numpy._core._multiarray_umath, torch._C (total: 2)
""")


def _error_file(tmp_path, dump: str | None) -> str:
    if dump is not None:
        (tmp_path / FAULT_FILE).write_text(dump)
    return str(tmp_path / "error.json")


def test_the_crashed_threads_frames_are_read_innermost_first():
    frames = crashed_stack(DUMP)
    assert [(os.path.basename(file), line, function) for file, line, function in frames][:4] == [
        ("distributed.py", 1473, "_ddp_init_helper"), ("distributed.py", 1079, "__init__"),
        ("train.py", 41, "build"), ("train.py", 77, "<module>")]
    assert frames[-1] == ("<string>", 1, "<module>")  # the other thread's frames are not its
    assert crashed_stack("Fatal Python error: Segmentation fault\n\n") == []
    one_thread = 'Stack (most recent call first):\n  File "/x/y.py", line 3 in f\n'  # all_threads=False
    assert crashed_stack(one_thread) == [("/x/y.py", 3, "f")]


def test_the_line_names_the_scripts_line_and_the_innermost_frame_and_the_stack_leaves_the_launcher_out(tmp_path):
    where, trace = crash_site(_error_file(tmp_path, DUMP), signal.SIGSEGV, environ={})
    assert where == "at /home/user/project/train.py:41, in torch/nn/parallel/distributed.py:1473 (_ddp_init_helper)"
    lines = trace.splitlines()
    assert lines[0] == "Python's stack when it died (faulthandler's, most recent call last):"
    assert lines[1:] == ['  File "/home/user/project/train.py", line 77, in <module>',
                         '  File "/home/user/project/train.py", line 41, in build',
                         f'  File "{DDP_FILE}", line 1079, in __init__',
                         f'  File "{DDP_FILE}", line 1473, in _ddp_init_helper']


def test_a_crash_in_ddps_constructor_under_detail_names_the_setting_and_its_fix(tmp_path):
    error_file = _error_file(tmp_path, DUMP)
    where, _ = crash_site(error_file, signal.SIGSEGV, environ={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL is set" in where and "rerun without it, or with INFO" in where
    for environ in ({}, {"TORCH_DISTRIBUTED_DEBUG": "INFO"}):  # not DETAIL: not named
        assert "TORCH_DISTRIBUTED_DEBUG" not in crash_site(error_file, signal.SIGSEGV, environ=environ)[0]
    elsewhere = DUMP.replace(DDP_FILE, os.path.join(TORCH_DIR, "functional.py"))
    detail = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    where, _ = crash_site(_error_file(tmp_path, elsewhere), signal.SIGSEGV, environ=detail)
    assert "TORCH_DISTRIBUTED_DEBUG" not in where  # a crash elsewhere is not blamed on the setting


def test_a_crash_in_the_scripts_own_line_is_named_once(tmp_path):
    dump = 'Current thread 0x1 (most recent call first):\n  File "/home/u/seg.py", line 9 in <module>\n'
    assert crash_site(_error_file(tmp_path, dump), signal.SIGABRT, environ={})[0] == "at /home/u/seg.py:9 (<module>)"


def test_no_site_without_a_stack_or_for_a_signal_that_dumps_none(tmp_path):
    assert crash_site(_error_file(tmp_path, None), signal.SIGSEGV) is None  # no file: the script took faulthandler
    assert crash_site(_error_file(tmp_path, ""), signal.SIGSEGV) is None
    assert crash_site(None, signal.SIGSEGV) is None  # no temporary directory for the files
    error_file = _error_file(tmp_path, DUMP)
    for signum in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):  # nothing dumps on these: a stale file says nothing
        assert crash_site(error_file, signum) is None


def test_the_failure_line_puts_the_step_after_the_signal_and_the_site_after_it(tmp_path):
    where, trace = crash_site(_error_file(tmp_path, DUMP), signal.SIGSEGV, environ={})
    reports = {0: worker_errors.error_report("RuntimeError: Connection closed by peer", echo=True),
               1: worker_errors.error_report(f"died (signal SIGSEGV) {where}", trace)}
    lines = str(worker_errors.failure(reports, 0, [4, 3])).splitlines()
    assert lines[0] == f"worker rank 1 failed: died (signal SIGSEGV) after step 3 {where}"
    assert lines[1:3] == ["--- rank 1 ---", "Python's stack when it died (faulthandler's, most recent call last):"]
    bare = {1: worker_errors.error_report("died (signal SIGSEGV)")}
    first = str(worker_errors.failure(bare, 1, [-1, 3])).splitlines()[0]
    assert first == "worker rank 1 failed: died (signal SIGSEGV) after step 3"


def test_the_asked_stack_is_the_thread_running_the_work_not_the_one_the_signal_struck(tmp_path):
    work = f'  File "{RUNTIME}", line 139 in _report_then_teardown\n'
    dump = ("Current thread 0x2 (most recent call first):\n"  # the request struck a comm thread
            f'  File "{STDLIB}/threading.py", line 331 in wait\n\n'
            "Thread 0x1 (most recent call first):\n"
            '  File "/home/u/train.py", line 12 in load\n  File "/home/u/train.py", line 30 in <module>\n' + work)
    (tmp_path / STACK_FILE).write_text(dump)
    where, trace = sites.where_it_was(str(tmp_path / "error.json"))
    assert where == "at /home/u/train.py:12 (load)"
    assert trace.splitlines()[1:] == ['  File "/home/u/train.py", line 30, in <module>',
                                      '  File "/home/u/train.py", line 12, in load']
    (tmp_path / STACK_FILE).write_text("")
    assert sites.where_it_was(str(tmp_path / "error.json")) is None  # never answered


def test_a_rank_that_had_not_reported_is_named_with_where_it_was():
    reports = {0: ("failed", "worker rank 1 was outside any collective (state: sleeping) while rank 0 waited", "", 1,
                   True)}
    trace = "Python's stack when the run stopped (...):\n  File \"/u/t.py\", line 7, in <module>"
    lines = str(worker_errors.failure(reports, 0, None, where={1: ("at t.py:7 (<module>)", trace)})).splitlines()
    assert lines == ["run stopped: worker rank 1 was outside any collective (state: sleeping) while rank 0 waited",
                     "rank 1 had not reported when the run stopped: it was at t.py:7 (<module>)",
                     '  File "/u/t.py", line 7, in <module>']


def test_a_process_that_listens_is_asked_and_answers_one_that_does_not_is_left_alone(tmp_path):
    error_file = str(tmp_path / "error.json")
    assert not catches_signal(os.getpid(), STACK_SIGNAL)
    ask_where([(os.getpid(), error_file)], wait_s=0.05)  # no handler: not sent (its default would end us)
    assert not (tmp_path / STACK_FILE).exists()
    with open(tmp_path / STACK_FILE, "w") as stack:
        faulthandler.register(STACK_SIGNAL, stack, all_threads=True)
        try:
            assert catches_signal(os.getpid(), STACK_SIGNAL)
            ask_where([(os.getpid(), error_file)])
        finally:
            faulthandler.unregister(STACK_SIGNAL)
    # the dump names this very test as the function its thread was in
    assert "in test_a_process_that_listens_is_asked_and_answers_one_that_does_not_is_left_alone" in (
        tmp_path / STACK_FILE).read_text()


def test_ctrl_c_says_where_each_rank_was_when_it_knows(tmp_path):
    from phalanx.errors import Interrupted
    from phalanx.runtime.lifeline import stop_message

    assert stop_message(Interrupted(["rank 0 at t.py:8, in phalanx/comm/calls.py:142 (wait_work)",
                                     "rank 1 at t.py:5 (slow_data)"])) == (
        "phalanx: interrupted; where each rank was:\nrank 0 at t.py:8, in phalanx/comm/calls.py:142 (wait_work)\n"
        "rank 1 at t.py:5 (slow_data)", 130)
    assert stop_message(Interrupted([])) == stop_message(KeyboardInterrupt()) == ("phalanx: interrupted", 130)
    assert "where each rank was: rank 1 at t.py:5" in str(Interrupted(["rank 1 at t.py:5"]))  # a notebook's line
    dump = 'Current thread 0x1 (most recent call first):\n  File "/u/t.py", line 5 in slow_data\n'
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / STACK_FILE).write_text(dump)
    files = [str(tmp_path / "0" / "error.json"), str(tmp_path / "1" / "error.json")]
    assert sites.interrupted_at(files, [0, 1]).where == ["rank 1 at /u/t.py:5 (slow_data)"]  # rank 0 never answered
