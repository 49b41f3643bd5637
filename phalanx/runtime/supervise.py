"""Run a set of fresh worker processes and watch over them: the one way phalanx starts processes.

`run_workers(WorkerSet(...))` starts `num_procs` fresh processes (forked by the fork server, else
spawned: runtime/fork_server.py; or copies of this process, `fork`, for phalanx.launch:
runtime/forked.py), each running `body(rank, payload, teardown)` with `env[rank]` added to its
environment, and returns their results by rank: for phalanx's own workers (`phalanx.runtime.launch`;
the body joins the world), `phalanx run`'s scripts and `bench.procs.run_fresh`'s contenders.

Each worker sends one report (its result, or its error) through its own pipe *before* its
`teardown` callbacks leave the process group, so a gloo abort at process exit (SIGABRT after
destroy_process_group, ~1 run in 80 where the group outlives it) cannot lose a finished result.
A group phalanx opens does not hit it (runtime/world.py's `_import_group_defaults` says why); a
contender or a user's script that opens its own group may. The first failure takes every worker
down, with whatever each started (its process group: SIGTERM, then SIGKILL; workers joined: no
orphans, no zombies), and the message names the rank that broke first, with its traceback; a rank
that only stopped because of it (its collective lost a peer: worker_errors.is_echo) gets one
line, "stopped too", and one that failed on its own with the same error one line, "failed too".
Each worker has torchrun's `TORCHELASTIC_ERROR_FILE` (worker_errors.py): what a script's `@record`
writes there completes the report of a worker that exited or died without one of its own, and
faulthandler's files beside it say where a worker crashed, or where one that had not reported was
when the run failed (the launcher asks it then: crash_site.py). Once
every result is in, the run has succeeded: teardown gets its own generous limit (`teardown_s`,
not the collective timeout), after which a worker still tearing down is killed without a word.
Workers write each output line in one piece and flush before they report or die of SIGTERM
(lifeline.line_buffered_output). A stopped launcher (SIGTERM, SIGHUP) first sends SIGTERM to each
worker alone: one whose training is armed for it finishes its step, saves there and reports
"stopped" (runtime/stop_request.py), one that is not dies of it; an interrupted one (Ctrl-C) sends
SIGINT, so a script's own `except KeyboardInterrupt` runs, as under torchrun; each to the worker's
main thread, where Python runs handlers (lifeline.signal_main_thread); past the grace, all go down.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Callable, Mapping, Sequence

from phalanx.runtime.fork_server import FRESH, LauncherState, worker_context
from phalanx.runtime.forked import START_METHODS, on_fresh_thread, reset_signals
from phalanx.runtime.fork_guard import guard_forks
from phalanx.runtime.segment import remove_segments_of, remove_torch_leftovers
from phalanx.runtime.host_limits import limit_reason
from phalanx.runtime.hash_seed import shared_hash_seed
from phalanx.runtime.oom import oom_kill_count, sigkill_cause
from phalanx.runtime.crash_site import ask_where, interrupted_at, where_it_was
from phalanx.runtime.procs import all_stopped
from phalanx.runtime.progress import adopt_slot, progress_array
from phalanx.runtime.worker_errors import (arm, blame_stopped, error_files, error_report, failure, is_echo, read_report,
                                           recorded, usage_line, user_traceback, with_recorded)
from phalanx.errors import RunFailed, Stopped, UsageError
from phalanx.runtime.lifeline import (INTERRUPT_GRACE_S, STOP_GRACE_S, die_with_parent, flush_on_sigterm,
                                     lead_own_group, line_buffered_output, signal_main_thread, signals_deferred,
                                     stop_on_signals, terminate)

# After a first failure, keep listening this long for the other ranks' reports: the first one to
# arrive is often a secondary "connection closed" from a peer of the rank that really broke.
ERROR_GRACE_S = 1.0
# How often a wait for reports also asks each worker whether it has exited (_ready says why).
EXIT_POLL_S = 0.2
# How long finished workers may take to leave the group and exit (measured under load: 1.8, 3.1
# and 3.7 s at 2, 4 and 8 workers) before they are killed; their results stand either way.
TEARDOWN_S = 30.0


@dataclass(frozen=True, kw_only=True)
class WorkerSet:
    """What to start and how long to wait. `body` must be module-level (spawn pickles it by name;
    fork copies it, and runs it on a fresh thread of the worker: runtime/forked.py)."""

    body: Callable[[int, Any, contextlib.ExitStack], Any]  # runs in worker `rank`; returns its result
    payload: Any
    num_procs: int
    env: Sequence[Mapping[str, str]] = ()  # per rank, added to the worker's os.environ first
    name: str = "phalanx-worker"
    deadline_s: float | None = None  # bound on results arriving; None: the body bounds its own waits
    teardown_s: float = TEARDOWN_S
    exit_zero_is_success: bool = False  # a worker that exits 0 without a report succeeded (result None)
    start_method: str = FRESH  # or "spawn" (always a new interpreter) or "fork" (a copy of this process)

    def __post_init__(self) -> None:
        if self.num_procs < 1:
            raise ValueError(f"num_procs {self.num_procs} must be at least 1")
        if self.env and len(self.env) != self.num_procs:
            raise ValueError(f"env has {len(self.env)} entries for {self.num_procs} processes")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ValueError(f"deadline_s {self.deadline_s} must be positive seconds or None")
        if not self.teardown_s > 0:
            raise ValueError(f"teardown_s {self.teardown_s} must be positive seconds")
        if self.start_method not in (FRESH, *START_METHODS):
            raise ValueError(f"start_method {self.start_method!r} is not one of {(FRESH, *START_METHODS)}")


def _worker_main(rank: int, workers: WorkerSet, conn, progress, parent_pid: int, error_file: str | None,
                 launcher: LauncherState | None = None) -> None:
    """One worker: run the body, send one report, then tear down (`launcher`: fork_server.py)."""
    if launcher is not None:  # forked by the fork server, whose death is the launcher's
        parent_pid = launcher.adopt()
    die_with_parent(parent_pid)
    lead_own_group()
    line_buffered_output()
    flush_on_sigterm()
    guard_forks()  # a DataLoader's fork right after a collective must not copy a held lock
    if workers.env:
        os.environ.update(workers.env[rank])
    arm(error_file)  # torchrun's error file, and faulthandler's beside it
    adopt_slot(progress, rank)  # this rank's last finished step, for a failure line (progress.py)
    if workers.start_method == "fork":
        reset_signals()
        exit_code = on_fresh_thread(_report_then_teardown, rank, workers, conn)
    else:
        exit_code = _report_then_teardown(rank, workers, conn)
    if launcher is not None:
        launcher.exit()
    if exit_code:
        raise SystemExit(exit_code)


def _report_then_teardown(rank: int, workers: WorkerSet, conn) -> int:
    """Run the body, send its one report, then tear down; the worker's exit code."""
    exit_code = 0
    with contextlib.ExitStack() as teardown:
        try:
            # Pickle here, not in a queue's feeder thread, so an unpicklable result is reported as
            # this worker's error; plain pickle copies tensor data into the bytes.
            result = workers.body(rank, workers.payload, teardown)
            try:
                report = pickle.dumps(("ok", result))
            except Exception as exc:  # noqa: BLE001 - the value returned is at fault, not the work: no traceback
                report, exit_code = pickle.dumps(error_report(
                    f"{type(exc).__name__}: the result it returned cannot be sent back ({exc}); return tensors, "
                    "numbers, strings, or lists, tuples and dicts of them")), 1
        except UsageError as exc:
            report, exit_code = pickle.dumps(("usage", usage_line(exc))), 2
        except Stopped as exc:  # asked to stop, it saved where it stopped (runtime/stop_request.py)
            report, exit_code = pickle.dumps(("stopped", exc.signum, exc.detail)), exc.exit_code
        except RunFailed as exc:  # a checked condition: the message is the whole story
            report, exit_code = pickle.dumps(("failed", str(exc).splitlines()[0], "", exc.culprit,
                                              exc.restartable)), 1
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
            summary = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
            limit = limit_reason(exc)  # a ulimit explains it: its line is the whole story, and it would repeat
            report, exit_code = pickle.dumps(error_report(summary, user_traceback(exc), is_echo(exc)) if limit is None
                                             else ("failed", limit, "", rank, False)), 1
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        # Deliver before teardown: send_bytes returns once the whole report is in the pipe.
        with contextlib.suppress(OSError):  # the parent is gone (interrupted): nobody is left to tell
            conn.send_bytes(report)
            conn.close()
    return exit_code


def run_workers(workers: WorkerSet) -> list[Any]:
    """Start the worker set, supervise it, and return the results by rank (or raise)."""
    ctx, launcher = worker_context() if workers.start_method == FRESH else (mp.get_context(workers.start_method), None)
    procs, conns, reports, failed, started_at = [], [], {}, False, time.time()
    with stop_on_signals(), error_files(workers.num_procs) as errors:
        try:
            oom_kills = oom_kill_count()  # before any worker exists: a rise is theirs (or a neighbour's)
            progress = progress_array(ctx, workers.num_procs)
            for rank in range(workers.num_procs):
                # A stop lands after the new worker is on the list; Python 3.12+ warns of any fork
                # in a process with threads (the store's): forked.py says what a copy undoes.
                with signals_deferred(), warnings.catch_warnings(), shared_hash_seed(ctx.get_start_method()):
                    warnings.simplefilter("ignore", DeprecationWarning)
                    parent_end, child_end = ctx.Pipe(duplex=False)
                    proc = ctx.Process(target=_worker_main, name=f"{workers.name}-{rank}",
                                       args=(rank, workers, child_end, progress, os.getpid(), errors[rank], launcher))
                    proc.start()
                    child_end.close()  # keep only the child's copy, so its death reads as EOF here
                    procs.append(proc)
                    conns.append(parent_end)
            return _supervise(procs, conns, workers, reports, progress=progress, errors=errors, oom_kills=oom_kills)
        except (Stopped, KeyboardInterrupt) as stop:
            raise _stop_gently(stop, procs, conns, reports, errors) from None
        except BaseException:
            failed = True
            raise
        finally:  # success, failure, deadline, Ctrl-C, SIGTERM: take every child down and reap it
            with signals_deferred():
                started = terminate(procs)  # the workers and every process they started
                for conn in conns:
                    conn.close()
                # A process killed between creating its shm segment and every rank mapping it (a
                # few ms at start) leaves the file behind; it is named after that process's pid.
                remove_segments_of(started)
                if failed:  # torch's files a DataLoader worker left on a full /dev/shm (segment.py)
                    remove_torch_leftovers(started_at)
                # Each reaped worker's 2 pipes, now, not when it is collected: a notebook keeps a failed
                # or interrupted launch's traceback, and so these frames and their descriptors, alive.
                for proc in procs:
                    with contextlib.suppress(ValueError):  # one still running (terminate gave up): left open
                        proc.close()


def _supervise(procs, conns, workers: WorkerSet, reports: dict[int, tuple], *, errors: Sequence[str | None],
               progress=None, oom_kills: int | None = None) -> list[Any]:
    """`reports`: filled as they arrive; `errors`: each rank's error file (worker_errors.error_files: one per
    rank, None without a temporary directory); `oom_kills`: the OOM killer's count at the start (oom.py)."""
    deadline = None if workers.deadline_s is None else time.monotonic() + workers.deadline_s
    first_failure: int | None = None
    give_up_at, pending = deadline, set(range(len(procs)))
    while pending and (first_failure is None or not all_stopped(procs[rank].pid for rank in pending)):
        timeout = None if give_up_at is None else give_up_at - time.monotonic()
        if timeout is not None and timeout <= 0:
            break
        for rank in _ready(procs, conns, pending, timeout):
            report = with_recorded(read_report(procs[rank], conns[rank], workers.exit_zero_is_success, errors[rank]),
                                   recorded(errors[rank]))
            pending.discard(rank)
            reports[rank] = report
            if report[0] != "ok" and first_failure is None:
                first_failure = rank  # the others' reports: soon after an error, after their saves for a stop
                grace_end = time.monotonic() + (STOP_GRACE_S if report[0] == "stopped" else ERROR_GRACE_S)
                give_up_at = grace_end if give_up_at is None else min(give_up_at, grace_end)
                if report[0] != "stopped":  # where each rank yet to report is now, should it never (crash_site.py);
                    # no wait here: the grace is for the others' reports, and the stacks are read after it
                    ask_where(((procs[other].pid, errors[other]) for other in pending), wait_s=0.0)
    if first_failure is not None and pending:  # a start-up wait that ran out for a stopped worker: name it
        first_failure = blame_stopped(reports, first_failure, {rank: procs[rank].pid for rank in pending})
    if first_failure is None and pending:
        first_failure = min(pending)
        ask_where((procs[rank].pid, errors[rank]) for rank in pending)
        for rank in sorted(pending):
            reports[rank] = error_report(f"gave no result within the {workers.deadline_s:g} s deadline (hung?)")
    if first_failure is None:
        teardown_end = time.monotonic() + workers.teardown_s
        _await_exit(procs, reports, teardown_end if deadline is None else min(deadline, teardown_end))
        first_failure = next((r for r in sorted(reports) if reports[r][0] != "ok"), None)
    if first_failure is None:
        return [reports[rank][1] for rank in range(len(procs))]
    where = {rank: found for rank in sorted(pending) if (found := where_it_was(errors[rank])) is not None}
    raise failure(reports, first_failure, progress, explain_kill=lambda: sigkill_cause(oom_kills, oom_kill_count()),
                  where=where)


def _ready(procs, conns, pending: set[int], timeout: float | None) -> list[int]:
    """The pending ranks with something to read - a report, or an exit - within `timeout` s.

    A worker's pipe and its process sentinel give EOF only when every process holding them has
    closed them, and the worker's forked children (DataLoader workers) hold both until they notice
    their parent is gone, seconds after a SIGKILL. Meanwhile a peer reports the death as its own
    error. So the worker itself is asked too (waitpid, through `exitcode`) before waiting, and
    again every EXIT_POLL_S: a dead worker is read as dead before its peers' echoes are judged."""
    exited = [rank for rank in sorted(pending) if procs[rank].exitcode is not None]
    if exited:
        return exited
    timeout = EXIT_POLL_S if timeout is None else min(timeout, EXIT_POLL_S)
    ready = set(wait([conns[r] for r in pending] + [procs[r].sentinel for r in pending], timeout))
    return sorted(r for r in pending if conns[r] in ready or procs[r].sentinel in ready
                  or procs[r].exitcode is not None)


def _stop_gently(stop: BaseException, procs, conns, reports: dict[int, tuple], errors) -> BaseException:
    """The launcher was stopped: its signal to each worker itself (not its group) first, as a
    terminal's Ctrl-C or torchrun's agent gives it. SIGTERM: an armed training finishes its step,
    saves and reports "stopped" (runtime/stop_request.py), one not armed dies of it at once; waits
    up to STOP_GRACE_S, and returns `stop` with the saved place, if any. Ctrl-C (SIGINT): a
    script's `except KeyboardInterrupt` and `finally` blocks run (an emergency save), and phalanx
    train, armed for it too, saves as for SIGTERM; waits up to INTERRUPT_GRACE_S (a forked worker
    hands it to the thread running its function: forked.on_fresh_thread). `reports`: those read before the stop,
    not asked for again (a worker tearing down after its report exits 0, its pipe empty: "without a result")."""
    interrupt = isinstance(stop, KeyboardInterrupt)
    if not interrupt and stop.detail is not None:
        return stop
    pending = {rank for rank in range(len(procs)) if rank not in reports}
    working = sorted(pending)  # where each is, asked before its SIGINT moves it (crash_site.py)
    if interrupt:
        ask_where((procs[rank].pid, errors[rank]) for rank in working)
    for rank in (rank for rank in pending if procs[rank].exitcode is None):
        with contextlib.suppress(OSError):
            signal_main_thread(procs[rank].pid, signal.SIGINT if interrupt else signal.SIGTERM)
    give_up_at, reports = time.monotonic() + (INTERRUPT_GRACE_S if interrupt else STOP_GRACE_S), dict(reports)
    while pending and give_up_at > time.monotonic():
        for rank in _ready(procs, conns, pending, give_up_at - time.monotonic()):
            pending.discard(rank)
            reports[rank] = read_report(procs[rank], conns[rank], False)
    kinds = {report[0] for report in reports.values()}
    if not reports or (interrupt and "stopped" not in kinds):  # phalanx train saves on Ctrl-C too; a script not
        return interrupted_at(errors, working) if interrupt else stop
    # Failed while stopping (a save not written): a failure. A death of the signal sent, or a peer's echo: the stop.
    failed = [rank for rank, report in sorted(reports.items()) if report[0] in ("failed", "usage")
              or (report[0] == "error" and not report[1].startswith("died") and not report[3])]
    if failed:
        return failure(reports, failed[0], None)
    if "stopped" in kinds:
        return Stopped(signal.SIGINT if interrupt else stop.signum,
                       detail=next(r[2] for r in reports.values() if r[0] == "stopped"))
    if kinds == {"ok"}:  # a script that asked phalanx.stop_requested and saved, or a run that was ending
        return Stopped(stop.signum, detail="and every worker ended its work by itself (exit 0)")
    return stop


def _await_exit(procs, reports: dict, give_up_at: float) -> None:
    """Every result is in: judge how each worker then exited (SIGABRT here is gloo's, tolerated).
    One still tearing down at `give_up_at` is left to the caller's terminate: its result stands."""
    for rank, proc in enumerate(procs):
        proc.join(max(0.0, give_up_at - time.monotonic()))
        if proc.exitcode == -signal.SIGABRT:
            warnings.warn(f"worker rank {rank} aborted (SIGABRT) after delivering its result: "
                          "gloo's exit-time abort (a process group still alive at interpreter exit); "
                          "its result is kept")
        elif proc.exitcode is not None and proc.exitcode != 0:
            reports[rank] = error_report(f"delivered its result but then exited with code {proc.exitcode}")
