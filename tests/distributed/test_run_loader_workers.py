"""A torchrun script whose DataLoader has worker processes, and no `__main__` guard, under
`phalanx run`: its loader workers start as under torchrun (the platform's start method, not
the launcher's spawn, which would re-run the script in every loader worker and have each call
`phalanx.init()`), so every pipeline ends bitwise equal to num_workers=0; and when a
loader worker raises, the run ends in seconds and nothing it started outlives it - no process
(loader workers, a resource tracker) and no segment in /dev/shm. A rank SIGKILLed while its
loader workers hold its pipe and sentinel open is named as the cause, not the peer that reported
its death first, with the last step it synced, also by `--max-restarts`; its orphaned loader
workers are ended too; one that calls os._exit is named with its code and step. A loader worker
that exits (os._exit in the dataset) ends the run in one line naming the rank, the loader
worker's pid and code, and num_workers=0 to see the error the worker took with it, whichever of
torch's two checks (its SIGCHLD handler, the loader's own after a get) sees it first.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from phalanx.runtime.script_errors import loader_worker_lost
from phalanx.runtime.segment import NAME_PREFIX, SHM_DIR

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parent / "scripts" / "loader_workers.py"
MARK = "PHALANX_LOADER_WORKERS_MARK"  # every process the run starts inherits it
PIPELINES = ["0", "2", "2-persistent"]


def _run(out: Path, *extra: str, launcher: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess, str, float]:
    mark = secrets.token_hex(8)
    env = {**os.environ, "OMP_NUM_THREADS": "1", MARK: mark}
    started = time.monotonic()
    ran = subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", *launcher, str(SCRIPT), "--out",
                          str(out), *extra], capture_output=True, text=True, timeout=300, env=env)
    return ran, mark, time.monotonic() - started


def _failed(out: Path, flag: str, *, within_s: float) -> tuple[subprocess.CompletedProcess, str, list[str]]:
    """`_run` with `flag`, which fails the run: exit 1 within `within_s`; the run, its mark, stderr's lines."""
    ran, mark, wall_s = _run(out, flag)
    assert ran.returncode == 1, ran.stderr[-3000:]
    assert wall_s < within_s, f"the failing run took {wall_s:.0f} s"
    return ran, mark, ran.stderr.splitlines()


def _marked(mark: str) -> list[int]:
    """Live processes whose environment carries `mark`: what the run started and left behind."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and needle in Path(f"/proc/{name}/environ").read_bytes().split(b"\0"):
                found.append(int(name))
        except OSError:
            continue  # gone, or not ours to read
    return found


def _assert_nothing_left(out: Path, mark: str) -> None:
    time.sleep(5)  # "5 s after the launcher exits"
    assert _marked(mark) == [], "processes the run started are still alive"
    pids = [int(p.name) for p in (out / "pids").iterdir()]
    segments = [n for n in os.listdir(SHM_DIR) if n.startswith(tuple(f"{NAME_PREFIX}{pid}-" for pid in pids))]
    assert segments == [], segments


def test_loader_workers_run_as_under_torchrun_and_equal_no_workers(tmp_path):
    ran, mark, _ = _run(tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert len(list((tmp_path / "pids").iterdir())) > 2, "the loaders started no worker process"
    for kind in ("sharded", "plain"):
        reference = torch.load(tmp_path / f"{kind}-0-rank0.pt", weights_only=True)
        for name in PIPELINES:
            for rank in range(2):
                state = torch.load(tmp_path / f"{kind}-{name}-rank{rank}.pt", weights_only=True)
                assert all(torch.equal(state[key], reference[key]) for key in reference), (kind, name, rank)
    _assert_nothing_left(tmp_path, mark)


def test_a_raising_loader_worker_ends_the_run_fast_and_leaves_nothing(tmp_path):
    ran, mark, lines = _failed(tmp_path, "--fail", within_s=30)  # at the default --timeout (120 s)
    assert lines[0].startswith("phalanx run: 2 workers on cpu"), lines[0]
    assert lines[1].startswith("phalanx: worker rank 1 failed: RuntimeError: Caught RuntimeError in DataLoader "
                               "worker process"), ran.stderr[-3000:]
    assert "a loader worker of rank 1 found bad data" in ran.stderr
    # One traceback, rank 1's, from the script down (not phalanx's own frames above it); rank 0,
    # which only stopped because rank 1 failed, is one line at most.
    assert sum(line.startswith("Traceback (most recent call last)") for line in lines) == 1, ran.stderr
    assert "phalanx/runtime/supervise.py" not in ran.stderr and "runpy" not in ran.stderr
    echoes = [line for line in lines if "rank 0" in line]
    assert all(line.startswith("rank 0 stopped too: ") for line in echoes) and len(echoes) <= 1, echoes
    _assert_nothing_left(tmp_path, mark)


def test_a_rank_killed_with_its_loader_workers_running_is_named_not_its_peer(tmp_path):
    ran, mark, lines = _failed(tmp_path, "--kill", within_s=60)
    # What the SIGKILL most likely was follows (runtime/oom.py): here no OOM kill, or a count unread.
    # Step 3 is the last its replica synced (the board told the launcher): the peer's line says it too.
    assert lines[1].startswith("phalanx: worker rank 1 failed: died (signal SIGKILL) after step 3: "), \
        ran.stderr[-3000:]
    # Rank 0 reported the death first (its allreduce lost rank 1): one line, no traceback.
    assert lines[2:] == [line for line in lines[2:] if line.startswith("rank 0 stopped too: ")], ran.stderr[-3000:]
    assert len(lines) == 3, ran.stderr[-3000:]
    _assert_nothing_left(tmp_path, mark)


def test_a_rank_that_calls_os_exit_is_named_with_its_code_and_step(tmp_path):
    ran, mark, lines = _failed(tmp_path, "--exit", within_s=60)
    assert lines[1] == "phalanx: worker rank 1 failed: exited with code 4 without a result after step 3", ran.stderr
    assert lines[2:] == [line for line in lines[2:] if line.startswith("rank 0 stopped too: ")], ran.stderr[-3000:]
    _assert_nothing_left(tmp_path, mark)


def test_a_loader_worker_that_exits_is_one_line_naming_rank_pid_code_and_fix(tmp_path):
    ran, mark, lines = _failed(tmp_path, "--loader-exit", within_s=30)
    # torch's own report was ~40 lines: its RuntimeError on each rank, chained to gloo's, with tracebacks.
    assert len(lines) == 2 and lines[0].startswith("phalanx run: 2 workers on cpu"), ran.stderr[-3000:]
    assert re.fullmatch(r"phalanx: run stopped: rank 1's DataLoader worker \(pid \d+\) exited with code 3"
                        r"( after step \d+)?: .*rerun with num_workers=0 to see it in the rank itself",
                        lines[1]), lines[1]
    _assert_nothing_left(tmp_path, mark)


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_loader_workers_started_by_spawn_from_the_unguarded_top_level_are_refused_naming_the_guard(tmp_path, context):
    """macOS's start method, and Linux's from Python 3.14: each worker would run the script again
    (phalanx.init() and a loader of its own included) and die of Python's bootstrapping error."""
    ran, mark, _ = _run(tmp_path, "--context", context)
    lines = ran.stderr.splitlines()
    assert ran.returncode == 2 and len(lines) == 2, ran.stderr[-3000:]
    assert re.fullmatch(r"phalanx: error: \S*loader_workers\.py:\d+: this starts a process by spawn or forkserver "
                        r"\(a DataLoader's workers: .*\), which runs the script's top level again before it can "
                        r"work, and line \d+ of loader_workers\.py, which led here, is not under `if __name__ == "
                        r"\"__main__\":`; .*multiprocessing_context=\"fork\".*", lines[1]), lines[1]
    assert "PhalanxWarning" not in ran.stderr  # no child ran the script again
    _assert_nothing_left(tmp_path, mark)


def test_max_restarts_restarts_after_the_killed_rank_not_its_peer(tmp_path):
    ran, mark, _ = _run(tmp_path, "--kill", launcher=("--max-restarts", "1"))
    assert ran.returncode == 0, ran.stderr[-3000:]
    restarts = [line for line in ran.stderr.splitlines() if "restart 1 of 1" in line]
    assert len(restarts) == 1, ran.stderr[-3000:]
    assert restarts[0].startswith("phalanx run: worker rank 1 (cpu:1) died (signal SIGKILL) after step 3: "), restarts[0]
    assert restarts[0].endswith("; restart 1 of 1: every worker starts again (TORCHELASTIC_RESTART_COUNT=1)"), restarts[0]
    _assert_nothing_left(tmp_path, mark)


class _Ending(Dataset):
    """Its loader worker ends itself at the first item: os._exit(3), or SIGKILL."""

    def __init__(self, how: str) -> None:
        self.how = how

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        if self.how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("how, said", [("exit", "exited with code 3"), ("kill", "was killed by signal")])
def test_torchs_error_for_a_loader_worker_that_ends_names_rank_pid_and_code(how, said):
    try:
        list(DataLoader(_Ending(how), num_workers=1))
    except RuntimeError as exc:  # raised by torch, here
        line = loader_worker_lost(exc, rank=1, step=5)
        assert line is not None, repr(exc)
        assert re.match(rf"rank 1's DataLoader worker \(pid \d+\) {said}.* after step 5: ", line), line
        assert line.endswith("rerun with num_workers=0 to see it in the rank itself"), line
        assert loader_worker_lost(RuntimeError(str(exc)), rank=1) is None  # the same words, not raised by torch
    else:
        raise AssertionError("the loader raised nothing")


@pytest.mark.parametrize("message, said", [
    ("DataLoader worker (pid 4242) exited unexpectedly with exit code 3. Details are lost due to multiprocessing. "
     "Rerunning with num_workers=0 may give better error trace.", "exited with code 3"),
    ("DataLoader worker (pid 4242) is killed by signal: Killed. ", "was killed by signal Killed"),
])
def test_torchs_sigchld_handler_error_names_rank_pid_and_code(message, said):
    """torch's SIGCHLD handler's words (C++, as a rank under `phalanx run` met them), raised from its module."""
    try:
        exec("raise RuntimeError(message)", {"__name__": "torch.utils.data._utils.signal_handling", "message": message})
    except RuntimeError as exc:
        assert loader_worker_lost(exc, rank=0) == (
            f"rank 0's DataLoader worker (pid 4242) {said}: its dataset's code (__getitem__, the collate_fn, a "
            "worker_init_fn) ended that process, whose own error is lost with it; rerun with num_workers=0 to see it "
            "in the rank itself")
