"""Where a worker that died of a fatal signal was in its Python code: the failure line names it.

A crash inside compiled code (torch's, a C extension's, the script's own ctypes call) killed a
worker with SIGSEGV, SIGBUS, SIGFPE, SIGILL or SIGABRT, and the failure line said "died (signal
SIGSEGV)" and no more (torchrun: "Signal 11 (SIGSEGV) received by PID ..."); the user had to rerun
under `python -X faulthandler` to learn which line. Each worker of a set now enables Python's
faulthandler, all threads, into a file of its own beside its error file (worker_errors.error_files),
and when a worker dies of one of those signals the launcher reads back the stack of the thread that
crashed: the line names the script's line (errors.authors_frame's rule) and the innermost frame,
and the stack becomes the rank's traceback. A file, not stderr: gloo's exit-time SIGABRT that the
launcher tolerates (supervise._await_exit) dumps there unseen. A script that enables faulthandler
itself takes it over (its stack goes to its own stderr), as a run under PYTHONFAULTHANDLER keeps it
there; the line is then the bare one.

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

from phalanx.errors import authors_frame, standard_library

FAULT_FILE = "fault.txt"  # beside the rank's error.json
# The signals faulthandler dumps a stack on (Python's documented set).
FATAL_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT})
_HEADER = re.compile(r"^(Current thread .*|Stack )\(most recent call first\):$")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_DDP_FILE = os.path.join("torch", "nn", "parallel", "distributed.py")


def fault_file(error_file: str | None) -> str | None:
    """The faulthandler file of the worker whose error file is `error_file` (None: none)."""
    return None if error_file is None else os.path.join(os.path.dirname(error_file), FAULT_FILE)


def enable(error_file: str | None) -> None:
    """In a worker: dump every thread's Python stack into its fault file on a fatal signal.
    Nothing where the file cannot be opened, or where the user asked for the dump on stderr
    (PYTHONFAULTHANDLER, -X faulthandler): the failure line is then the bare one."""
    path = fault_file(error_file)
    if path is None or os.environ.get("PYTHONFAULTHANDLER") or "faulthandler" in sys._xoptions:
        return
    try:
        handle = open(path, "w")  # faulthandler keeps the object (and so the descriptor) alive
    except OSError:
        return
    faulthandler.enable(handle, all_threads=True)


def crashed_stack(text: str) -> list[tuple[str, int, str]]:
    """(file, line, function) of the crashed thread's frames in faulthandler's dump `text`,
    innermost first ([] where it holds none)."""
    frames, inside = [], False
    for line in text.splitlines():
        if _HEADER.match(line):
            if inside:  # another thread's block (its own header): the crashed one came first
                break
            inside = True
        elif inside:
            found = _FRAME.match(line)
            if found is None and frames:
                break
            if found is not None:
                frames.append((found[1], int(found[2]), found[3]))
    return frames


def crash_site(error_file: str | None, signum: int, environ=os.environ) -> tuple[str, str] | None:
    """(what to add to the "died (signal ...)" line, the stack as the rank's traceback) for a worker
    that died of `signum`, from its fault file; None where the signal dumps nothing or the file holds
    no stack (faulthandler taken over by the script, no file)."""
    path = fault_file(error_file)
    if signum not in FATAL_SIGNALS or path is None:
        return None
    try:
        with open(path, errors="replace") as handle:
            text = handle.read()
    except OSError:
        return None
    frames = crashed_stack(text)
    if not frames:
        return None
    innermost = frames[0]
    found = authors_frame([(file, line, function) for file, line, function in frames])
    author = None if found is None else found[0]
    where = f"at {_shown(innermost[0])}:{innermost[1]} ({innermost[2]})"
    if author is not None and author != innermost:
        where = f"at {_shown(author[0])}:{author[1]}, in {_shown(innermost[0])}:{innermost[1]} ({innermost[2]})"
    if environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL" and innermost[0].endswith(_DDP_FILE):
        where += ("; TORCH_DISTRIBUTED_DEBUG=DETAIL is set, under which torch's DDP constructor dies of SIGSEGV "
                  "(torch 2.13, torchrun alike): rerun without it, or with INFO, which still names unused parameters")
    shown = _below_launcher(frames)
    trace = "Python's stack when it died (faulthandler's, most recent call last):\n" + "\n".join(
        f'  File "{file}", line {line}, in {function}' for file, line, function in reversed(shown))
    return where, trace


def _below_launcher(frames: list[tuple[str, int, str]]) -> list[tuple[str, int, str]]:
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
    one under the working directory relative to it."""
    absolute, stdlib = os.path.abspath(path), os.path.dirname(os.__file__) + os.sep
    if standard_library(absolute, stdlib) and absolute.startswith(stdlib):
        return os.path.relpath(absolute, stdlib)
    for root in sorted({os.path.abspath(entry) for entry in sys.path if entry}, key=len, reverse=True):
        if ("site-packages" in root or "dist-packages" in root) and absolute.startswith(root + os.sep):
            return os.path.relpath(absolute, root)
    relative = os.path.relpath(absolute)
    return absolute if relative.startswith("..") else relative
