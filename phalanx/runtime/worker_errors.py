"""What a failed worker says about itself: torch elastic's error file, and whether its error echoes a peer's.

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
import shutil
import tempfile
from typing import Iterator

from phalanx.errors import PeerLost

ERROR_FILE_VAR = "TORCHELASTIC_ERROR_FILE"
# What gloo's errors say when the peer at the other end of a collective went away.
_CONNECTION_LOST = ("connection closed by peer", "connection reset by peer")


@contextlib.contextmanager
def error_files(num_procs: int) -> Iterator[list[str]]:
    """One error file path per rank in a fresh private directory (the files themselves are the
    workers' to write); the directory goes when the block ends."""
    directory = tempfile.mkdtemp(prefix="phalanx-errors-")
    try:
        paths = []
        for rank in range(num_procs):
            os.mkdir(os.path.join(directory, str(rank)))
            paths.append(os.path.join(directory, str(rank), "error.json"))
        yield paths
    finally:
        shutil.rmtree(directory, ignore_errors=True)


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
