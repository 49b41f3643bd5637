"""What a worker reports to its launcher, and how a failed run's message reads from the reports.

Each worker sends one report: ("ok", result), ("usage", line), ("failed", line, ...) for a
checked condition, ("stopped", signal, where it saved) for a stop it saved at, or an error
report (`error_report`: its line, the user's traceback, whether it echoes a peer's failure);
`read_report` makes one of a worker's death too. `failure` turns the reports into the one
exception the launcher raises: the rank at fault first, with its traceback.

Also torch elastic's error file, and whether an error echoes a peer's.

torchrun gives each worker a path of its own in `TORCHELASTIC_ERROR_FILE`; a script whose entry
point is decorated with torch's `@record` (torch.distributed.elastic.multiprocessing.errors)
writes its uncaught exception there as JSON - {"message": {"message": "ValueError: ...",
"extraInfo": {"py_callstack": "Traceback ...", "timestamp": "..."}}} in torch 2.11 to 2.13, a
plain string under "message" in the format torch's agent also accepts - and the agent puts it in
its failure report. `error_files` gives phalanx's workers the same (a fresh directory per worker
set, removed with it, one `<rank>/error.json` each, as torchrun lays them out), and `recorded`
reads one back, so the failure line carries what the worker recorded where phalanx saw no
exception of its own (a script that records its error, then exits with a code or dies).

A rank's error is an echo - the launcher's "rank r stopped too" - only when it failed because
another rank did: phalanx's own peer-died and abort errors (`PeerLost`: PeerGone,
CollectiveAborted, the shm allreduce's ShmPeerGone), or a collective whose connection the peer
closed (gloo's RuntimeError "... Connection closed by peer" or "... reset by peer", raised from
the collective or from a DDP backward alike). Any other error is the rank's own, however alike it
is on two ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
import tempfile
import traceback
from typing import Callable, Iterator

import torch

from phalanx.errors import PACKAGE_DIR, PeerLost, Stopped, UsageError
from phalanx.runtime.crash_site import crash_site, enable as enable_fault_file
from phalanx.runtime.fork_server import lost_server
from phalanx.runtime.lifeline import describe_signal
from phalanx.runtime.procs import STOPPED, process_state
from phalanx.runtime.segment import stale_leftovers

ERROR_FILE_VAR = "TORCHELASTIC_ERROR_FILE"
ERRORS_PREFIX = "phalanx-errors-"  # then the launcher's pid: the directory of its workers' error files
# The report of a worker that exited 0 without a result where that counts as success: a result of None.
LEFT_EARLY = ("ok", None, "exited 0 without a result")
# What gloo's errors say when the peer at the other end of a collective went away.
_CONNECTION_LOST = ("connection closed by peer", "connection reset by peer")
KILLED = f"died ({describe_signal(signal.SIGKILL)})"  # read_report's line for a worker SIGKILL ended


@contextlib.contextmanager
def error_files(num_procs: int) -> Iterator[list[str | None]]:
    """One error file path per rank in a fresh private directory (the files themselves are the
    workers' to write); the directory goes when the block ends, and those of launchers killed
    outright (SIGKILL: no block ends) go at the next launch.

    The files only add a recorded message to a failure line, so where no temporary directory can
    be made (a read-only /tmp under `docker --read-only`, no descriptor left under `ulimit -n`)
    every rank gets None and the run goes on without them; before, the launcher died there in a
    47-line traceback."""
    try:
        temp_root = tempfile.gettempdir()
        for name in stale_leftovers(temp_root, ERRORS_PREFIX):
            shutil.rmtree(os.path.join(temp_root, name), ignore_errors=True)
        directory = tempfile.mkdtemp(prefix=f"{ERRORS_PREFIX}{os.getpid()}-")
    except OSError:  # gettempdir's "No usable temporary directory" is a FileNotFoundError
        yield [None] * num_procs
        return
    try:
        paths = []
        for rank in range(num_procs):
            os.mkdir(os.path.join(directory, str(rank)))
            paths.append(os.path.join(directory, str(rank), "error.json"))
        yield paths
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def arm(error_file: str | None) -> None:
    """In a worker: its error file in torchrun's variable (as torchrun's agent gives each worker one of
    its own), and faulthandler's files beside it (crash_site.py); None: no temporary directory for them."""
    if error_file is not None:
        os.environ[ERROR_FILE_VAR] = error_file
        enable_fault_file(error_file)


def recorded(path: str | None) -> tuple[str, str] | None:
    """(the message, the traceback or '') a worker wrote to its error file, or None when it
    wrote none (or nothing readable)."""
    if path is None:
        return None
    try:
        with open(path) as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        extra = message.get("extraInfo") if isinstance(message.get("extraInfo"), dict) else {}
        text, trace = message.get("message"), extra.get("py_callstack", "")
    else:
        text, trace = message, ""
    if not isinstance(text, str) or not text.strip():
        return None
    return text.strip().splitlines()[0], trace if isinstance(trace, str) else ""


def is_echo(exc: BaseException) -> bool:
    """Whether `exc` was raised because another rank failed (see the module docstring)."""
    if isinstance(exc, PeerLost):
        return True
    # gloo's are plain RuntimeErrors; an OSError of the script's own (its HTTP client's) is not one.
    return isinstance(exc, RuntimeError) and any(words in str(exc).lower() for words in _CONNECTION_LOST)


# The launcher's own frames, above the user's code in every worker's traceback (left out of reports).
PLUMBING = ("phalanx.runtime.supervise", "phalanx.runtime.launch", "phalanx.runtime.script",
             "phalanx.runtime.main_module", "phalanx.runtime.function_launch", "runpy")


class WorkerFailed(RuntimeError):
    """A worker raised, died or hung; line one names the rank, then every report collected.

    `rank`: the rank at fault, when one is known; `restartable`: whether starting the workers
    again from a checkpoint can get past it (a death, an error, a worker that stopped responding:
    yes; a checked condition that would repeat, such as a NaN loss: no). `--max-restarts` reads
    these, never the message. `traceback`: the rank at fault's own report (its traceback), "" for a
    death; a restart line shows it, as torchrun's worker prints its own before a restart."""

    def __init__(self, message: str, *, rank: int | None = None, restartable: bool = False,
                 traceback: str = "") -> None:
        super().__init__(message)
        self.rank, self.restartable, self.traceback = rank, restartable, traceback


def failure(reports: dict[int, tuple], first_failure: int, progress,
            explain_kill: Callable[[], str] | None = None,
            where: dict[int, tuple[str, str]] | None = None) -> BaseException:
    """The exception a failed (or stopped) worker set ends in, from every report collected;
    `explain_kill()` says what a root cause's SIGKILL most likely was (runtime/oom.py); `where`:
    (where, stack) of each rank that had not reported, asked as the run failed (crash_site.py),
    named after the rest."""
    found = _failure(reports, first_failure, progress, explain_kill)
    if not where or not isinstance(found, WorkerFailed):
        return found
    lines = [str(found)]
    for rank, (place, trace) in sorted(where.items()):
        lines += [f"rank {rank} had not reported when the run stopped: it was {place}", *trace.splitlines()[1:]]
    return WorkerFailed("\n".join(lines), rank=found.rank, restartable=found.restartable, traceback=found.traceback)


def _failure(reports: dict[int, tuple], first_failure: int, progress,
             explain_kill: Callable[[], str] | None = None) -> BaseException:
    stopped = [report for _, report in sorted(reports.items()) if report[0] == "stopped"]
    if stopped and all(report[0] in ("ok", "stopped") for report in reports.values()):
        # Asked to stop (a worker's SIGTERM, not the launcher's): every rank saved and stopped.
        return Stopped(stopped[0][1], detail=stopped[0][2])
    usage = [report[1] for _, report in sorted(reports.items()) if report[0] == "usage"]
    if usage:  # bad input is the user's to fix: one line, whatever the other ranks then hit
        return UsageError(usage[0])
    checked = [report for _, report in sorted(reports.items()) if report[0] == "failed"]
    if checked:  # every rank checks the same gathered values: one line says it all
        _, line, _, culprit, restartable = checked[0]
        return WorkerFailed(f"run stopped: {line}", rank=culprit, restartable=restartable)
    failed = {rank: report for rank, report in sorted(reports.items()) if report[0] not in ("ok", "stopped")}
    # The root cause first: a rank that died (signal, exit without a report) explains its peers'
    # "connection closed" errors, even when one of those reached us first; else the first report
    # (they arrive in `reports` in order) that is not a collective's echo of a peer gone.
    died = [rank for rank, report in failed.items() if report[1].startswith(("died", "exited with code"))]
    own = [rank for rank, report in failed.items() if not report[3]]
    left = [rank for rank, report in sorted(reports.items()) if report == LEFT_EARLY]
    if left and not died and not own:  # only echoes: of the rank that left (os._exit(0)) while they waited
        return _left_early(left[0], failed, progress)
    first_failure = (died or own or [first_failure if first_failure in failed else min(failed)])[0]
    root = reports[first_failure]
    line = root[1]
    if progress is not None and progress[first_failure] >= 0:
        line = _after_step(line, progress[first_failure])
    if explain_kill is not None and root[1] == KILLED:
        line = f"{line}: {explain_kill()}"
    # The root's traceback, and any other rank's that says something else; a rank that only
    # stopped because of the root (its collective lost a peer) gets one line, and so does one
    # that failed on its own with the root's very error.
    # (A root with no traceback, a death, is its first line alone: not said twice.)
    sections = [f"--- rank {first_failure} ---\n{root[2].rstrip()}"] if root[2] else []
    for rank, report in failed.items():
        if rank != first_failure:
            sections.append(f"rank {rank} stopped too: {report[1]}" if report[3] else
                            f"rank {rank} failed too: {report[1]}" if report[1] == root[1] else
                            f"--- rank {rank} ---\n{(report[2] or report[1]).rstrip()}")
    return WorkerFailed(f"worker rank {first_failure} failed: {line}\n" + "\n".join(sections), rank=first_failure,
                        restartable=True, traceback=(root[2] or "").rstrip())


def _after_step(line: str, step: int) -> str:
    """`line` with the step it failed after: after "died (signal SIGSEGV)" where a crash site follows."""
    if line.startswith("died (") and ") " in line:
        signal_part, site = line.split(") ", 1)
        return f"{signal_part}) after step {step} {site}"
    return f"{line} after step {step}"


def _left_early(rank: int, failed: dict[int, tuple], progress) -> WorkerFailed:
    """Rank `rank` exited 0 without a result (`os._exit(0)`, which skips the board's "finished"
    mark) while the `failed` ranks, all echoes of its going, waited for it: a success under
    torchrun's rule only while no peer needs it, so it is the rank at fault, and as sys.exit(0)
    mid-run (watchdog.PeerFinished) it would repeat: not restartable."""
    after = f" after step {progress[rank]}" if progress is not None and progress[rank] >= 0 else ""
    waiters = sorted(failed)
    who = f"rank {waiters[0]} waits" if len(waiters) == 1 else f"ranks {', '.join(map(str, waiters))} wait"
    lines = [f"worker rank {rank} failed: exited (code 0) without finishing its part{after} while {who} for it in a "
             f"collective; every rank must make the same collective calls (did rank {rank} call os._exit(0), or "
             "return before the others?)"]
    lines += [f"rank {r} stopped too: {report[1]}" for r, report in failed.items()]
    return WorkerFailed("\n".join(lines), rank=rank, restartable=False)


# What a store wait that ran out says (torch's DistStoreError): start-up's rendezvous, before the
# collectives' watchdog exists to name a peer that never came.
_STORE_TIMEOUT = ("DistStoreError", "wait timeout", "Timed out")


def blame_stopped(reports: dict[int, tuple], first_failure: int, pending_pids: dict[int, int]) -> int:
    """A worker whose store wait ran out while another sits stopped (SIGSTOP, Ctrl-Z, a debugger)
    failed because of it: the stopped one is reported as the cause, the waiter's timeout as its
    echo. Returns the rank at fault (`first_failure` when no such case). `pending_pids`: the pids
    of the workers that gave no report, by rank."""
    root = reports[first_failure]
    if root[0] != "error" or not any(words in root[1] for words in _STORE_TIMEOUT):
        return first_failure
    for rank, pid in sorted(pending_pids.items()):
        if process_state(pid) in STOPPED:
            reports[rank] = error_report(f"stopped responding (state: stopped) during start-up, while rank "
                                         f"{first_failure} waited for it (SIGSTOP, Ctrl-Z or a debugger?)")
            reports[first_failure] = (*root[:3], True)
            return rank
    return first_failure


def error_report(line: str, trace: str = "", echo: bool = False) -> tuple:
    """An error report: its one line, its traceback, whether it echoes another rank's failure."""
    return ("error", line, trace, echo)


def user_traceback(exc: BaseException) -> str:
    """`exc`'s traceback from the first frame that is not the launcher's own (supervise, launch,
    script, runpy above the user's code on every rank): what `python script.py` would print."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_globals.get("__name__") in PLUMBING:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def usage_line(exc: UsageError) -> str:
    """`exc`'s line, led by the place in the user's code whose call phalanx refused (`train.py:12: `):
    the innermost frame of its traceback that is not phalanx's, the standard library's or torch's
    (a call made inside a `with` block still names the script's line, not contextlib's). The bare
    line where there is none (phalanx's own commands, whose flags the line names), or where the
    user's code raised it itself (its own words)."""
    where, raised_by_user = None, False
    tb = exc.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        raised_by_user = not filename.startswith(("<", *_NOT_THE_USERS))
        if raised_by_user:
            where = (filename, tb.tb_lineno)
        tb = tb.tb_next
    if where is None or raised_by_user:
        return str(exc)
    relative = os.path.relpath(where[0])
    return f"{where[0] if relative.startswith('..') else relative}:{where[1]}: {exc}"


_NOT_THE_USERS = (PACKAGE_DIR, *{os.path.dirname(module.__file__) + os.sep for module in (contextlib, torch)})


def with_recorded(report: tuple, found: tuple[str, str] | None) -> tuple:
    """`report` completed with what the worker recorded in its error file (`found`: message,
    traceback): a line that lacks the message gets it, a report without a traceback takes its."""
    if found is None or report[0] not in ("error", "failed") or found[0] in report[1]:
        return report
    line = f"{report[1]}: {found[0]}"
    if report[0] == "failed":
        return (report[0], line, *report[2:])
    return (report[0], line, report[2] or found[1], report[3])


def read_report(proc, conn, exit_zero_is_success: bool, error_file: str | None = None) -> tuple:
    """This worker's report, or a report of its death (all it sent is in the pipe once it exits); a
    fatal signal's with where it struck, from the fault file beside `error_file` (crash_site.py)."""
    try:
        if conn.poll(0):
            return pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        pass  # the pipe closed without a report: the worker is dead, or about to be
    except Exception as exc:  # noqa: BLE001 - a result this process cannot unpickle
        return error_report(f"result could not be unpickled: {type(exc).__name__}: {exc}", traceback.format_exc())
    proc.join(1)
    if proc.exitcode is None:
        return error_report("closed its result pipe but kept running")
    if proc.exitcode < 0:
        site = crash_site(error_file, -proc.exitcode)
        line = f"died ({describe_signal(-proc.exitcode)})"
        return error_report(line) if site is None else error_report(f"{line} {site[0]}", site[1])
    if proc.exitcode == 0 and exit_zero_is_success:  # os._exit(0) before the end: success, as under torchrun,
        return LEFT_EARLY  # unless its peers then fail waiting for it (`failure`)
    server = lost_server(proc) if proc.exitcode == 255 else None
    if server is not None:
        return error_report(f"died with the fork server that started the workers (pid {server}), which ended while "
                            "they ran (killed from outside?); rerun the command")
    return error_report(f"exited with code {proc.exitcode} without a result")
