"""Where a worker was in its Python code when it crashed, or when the run stopped while it hung.

A crash inside compiled code (torch's, a C extension's, the script's own ctypes call) killed a
worker with SIGSEGV, SIGBUS, SIGFPE, SIGILL or SIGABRT, and the failure line said "died (signal
SIGSEGV)" and no more (torchrun: "Signal 11 (SIGSEGV) received by PID ..."); a rank that never
reached a collective was named with its process state ("sleeping") and no place. The user had to
rerun under `python -X faulthandler`, or attach py-spy in time, to learn which line.

Each worker of a set enables Python's faulthandler, all threads, into files of its own beside its
error file (worker_errors.error_files): on a fatal signal into `fault.txt`, and on STACK_SIGNAL (a
real-time signal, which no library listens for) into `stack.txt`. When a worker dies of a fatal
signal the launcher reads back the stack of the thread that crashed; when the run fails while a
worker has not reported (a rank busy elsewhere while its peers wait, a deadline), the launcher
asks it for its stack first (`ask_where`), once, and reads the thread that runs its work. Each
is named by the script's line (errors.authors_frame's rule) and the innermost frame, and its
stack goes into the report. Files, not stderr: gloo's exit-time SIGABRT that the launcher
tolerates (supervise._await_exit) dumps there unseen. A script that enables faulthandler itself
takes the fatal dump over (its stack goes to its own stderr), as a run under PYTHONFAULTHANDLER
keeps it there; the line is then the bare one. A worker whose STACK_SIGNAL has no handler (its
default would end it) is not asked.

One crash has a known cause, named with its fix: torch's DDP constructor dies of SIGSEGV whenever
TORCH_DISTRIBUTED_DEBUG=DETAIL is set (torch 2.13.0, CPU, 1 or 2 ranks, under torchrun alike;
INFO runs), the setting torch's own unused-parameter error recommends.
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import sys
import time
from typing import Iterable

from phalanx.errors import PACKAGE_DIR, Interrupted, authors_frame, standard_library
from phalanx.runtime.procs import STOPPED, catches_signal, process_state

FAULT_FILE, STACK_FILE = "fault.txt", "stack.txt"  # beside the rank's error.json
# The signals faulthandler dumps a stack on (Python's documented set).
FATAL_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT})
# The launcher's request for a worker's stack: a real-time signal (Linux), whose default action ends
# a process, so it is sent only to a worker whose /proc entry shows it caught (procs.catches_signal).
STACK_SIGNAL = signal.SIGRTMIN + 5 if hasattr(signal, "SIGRTMIN") else None
ASK_WAIT_S = 1.0  # at most, for the asked stacks to be written (a few ms where each worker gets a core)
_HEADER = re.compile(r"^(Current thread|Thread|Stack)\b.*\(most recent call first\):$")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_DDP_FILE = os.path.join("torch", "nn", "parallel", "distributed.py")
_WORK = (os.path.join(os.path.dirname(os.path.abspath(__file__)), "supervise.py"), "_report_then_teardown")

Frame = tuple[str, int, str]  # (file, line, function)


def _beside(error_file: str | None, name: str) -> str | None:
    return None if error_file is None else os.path.join(os.path.dirname(error_file), name)


def enable(error_file: str | None) -> None:
    """In a worker: dump every thread's Python stack into its fault file on a fatal signal (unless
    the user asked for that dump on stderr: PYTHONFAULTHANDLER, -X faulthandler), and into its
    stack file on STACK_SIGNAL. Nothing where the files cannot be opened."""
    if error_file is None:
        return
    try:  # faulthandler keeps each file object (and so its descriptor) alive
        fault, stack = open(_beside(error_file, FAULT_FILE), "w"), open(_beside(error_file, STACK_FILE), "w")
    except OSError:
        return
    if not (os.environ.get("PYTHONFAULTHANDLER") or "faulthandler" in sys._xoptions):
        faulthandler.enable(fault, all_threads=True)
    if STACK_SIGNAL is not None:
        faulthandler.register(STACK_SIGNAL, stack, all_threads=True)


def thread_stacks(text: str) -> list[tuple[bool, list[Frame]]]:
    """Each thread's frames in faulthandler's dump `text`, innermost first, with whether it is
    the thread the signal struck (faulthandler's "Current thread"; the one stack of a dump made
    without all_threads)."""
    stacks: list[tuple[bool, list[Frame]]] = []
    for line in text.splitlines():
        if _HEADER.match(line):
            stacks.append((not line.startswith("Thread"), []))
        elif stacks and (found := _FRAME.match(line)) is not None:
            stacks[-1][1].append((found[1], int(found[2]), found[3]))
    return [(current, frames) for current, frames in stacks if frames]


def crashed_stack(text: str) -> list[Frame]:
    """The crashed thread's frames in a fatal signal's dump, innermost first ([] where none)."""
    return next((frames for current, frames in thread_stacks(text) if current), [])


def crash_site(error_file: str | None, signum: int, environ=os.environ) -> tuple[str, str] | None:
    """(what to add to the "died (signal ...)" line, the stack as the rank's traceback) for a worker
    that died of `signum`, from its fault file; None where the signal dumps nothing or the file holds
    no stack (faulthandler taken over by the script, no file)."""
    if signum not in FATAL_SIGNALS:
        return None
    frames = crashed_stack(_read(_beside(error_file, FAULT_FILE)))
    if not frames:
        return None
    where = _where(frames)
    if environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL" and frames[0][0].endswith(_DDP_FILE):
        where += ("; TORCH_DISTRIBUTED_DEBUG=DETAIL is set, under which torch's DDP constructor dies of SIGSEGV "
                  "(torch 2.13, torchrun alike): rerun without it, or with INFO, which still names unused parameters")
    return where, _trace("when it died", frames)


def ask_where(workers: Iterable[tuple[int, str | None]], wait_s: float = ASK_WAIT_S) -> None:
    """Ask each worker (pid, error file) that is still running and listens for STACK_SIGNAL to write
    its stack, then wait up to `wait_s` for those stacks to be whole. A stopped worker is not asked
    (it could not write), nor one with no handler for the signal (its default would end it)."""
    asked = []
    for pid, error_file in workers:
        path = _beside(error_file, STACK_FILE)
        if STACK_SIGNAL is None or path is None or process_state(pid) in (None, *STOPPED):
            continue
        if catches_signal(pid, STACK_SIGNAL):
            try:
                os.kill(pid, STACK_SIGNAL)
                asked.append(path)
            except OSError:
                continue  # gone meanwhile
    give_up_at, sizes = time.monotonic() + wait_s, None
    while asked and time.monotonic() < give_up_at:  # until every stack is written: there, and grown no more
        now = [_size(path) for path in asked]
        if all(now) and now == sizes:
            return
        sizes = now
        time.sleep(0.02)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def where_it_was(error_file: str | None) -> tuple[str, str] | None:
    """(where, the stack) of a worker asked by `ask_where`: the thread that runs its work (the
    script, the training), else the one the request struck; None where it wrote none."""
    stacks = thread_stacks(_read(_beside(error_file, STACK_FILE)))
    working = [frames for _, frames in stacks if any((f[0], f[2]) == _WORK for f in frames)]
    frames = (working or [frames for current, frames in stacks if current] or [[]])[0]
    return (_where(frames), _trace("when the run stopped", frames)) if frames else None


def interrupted_at(error_files, ranks: Iterable[int]) -> Interrupted:
    """Ctrl-C's exception, with where each of `ranks` was when asked (`ask_where`), one line each;
    `error_files`: every rank's (worker_errors.error_files)."""
    found = {rank: where_it_was(error_files[rank]) for rank in sorted(ranks)}
    return Interrupted([f"rank {rank} {site[0]}" for rank, site in found.items() if site is not None])


def _read(path: str | None) -> str:
    if path is None:
        return ""
    try:
        with open(path, errors="replace") as handle:
            return handle.read()
    except OSError:
        return ""


def _where(frames: list[Frame]) -> str:
    """"at train.py:4, in torch/nn/parallel/distributed.py:1473 (_ddp_init_helper)": the script's line
    first where it is not the innermost frame."""
    innermost = frames[0]
    found = authors_frame(list(frames))
    author = None if found is None else found[0]
    where = f"at {_shown(innermost[0])}:{innermost[1]} ({innermost[2]})"
    if author is not None and author != innermost:
        where = f"at {_shown(author[0])}:{author[1]}, in {_shown(innermost[0])}:{innermost[1]} ({innermost[2]})"
    return where


def _trace(when: str, frames: list[Frame]) -> str:
    shown = _below_launcher(frames)
    return f"Python's stack {when} (faulthandler's, most recent call last):\n" + "\n".join(
        f'  File "{file}", line {line}, in {function}' for file, line, function in reversed(shown))


def _below_launcher(frames: list[Frame]) -> list[Frame]:
    """`frames` (innermost first) without the outer ones that start every worker (the standard
    library's multiprocessing and runpy, phalanx's runtime), as a traceback leaves them out; all of
    them where nothing else is left."""
    stdlib, runtime = os.path.dirname(os.__file__) + os.sep, os.path.dirname(os.path.abspath(__file__)) + os.sep
    kept = len(frames)
    while kept > 0 and (frames[kept - 1][0].startswith(("<", runtime))
                        or standard_library(frames[kept - 1][0], stdlib)):
        kept -= 1
    return frames[:kept] or frames


def _shown(path: str) -> str:
    """`path` as a failure line shows it: an installed package's from its package folder
    (torch/nn/parallel/distributed.py), the standard library's from its own (ctypes/__init__.py),
    phalanx's from its own (phalanx/comm/watchdog.py), one under the working directory relative to it."""
    absolute, stdlib = os.path.abspath(path), os.path.dirname(os.__file__) + os.sep
    if standard_library(absolute, stdlib) and absolute.startswith(stdlib):
        return os.path.relpath(absolute, stdlib)
    if absolute.startswith(PACKAGE_DIR):  # phalanx's own, wherever it is installed from
        return os.path.relpath(absolute, os.path.dirname(PACKAGE_DIR.rstrip(os.sep)))
    for root in sorted({os.path.abspath(entry) for entry in sys.path if entry}, key=len, reverse=True):
        if ("site-packages" in root or "dist-packages" in root) and absolute.startswith(root + os.sep):
            return os.path.relpath(absolute, root)
    relative = os.path.relpath(absolute)
    return absolute if relative.startswith("..") else relative
