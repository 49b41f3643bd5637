"""Workers forked from a server that imported torch once, instead of k fresh interpreters.

A spawned worker is a new interpreter that imports torch before it does anything: about 3 s of
one core on the 2-core CI machine, paid by every worker of every launch and every restart.
multiprocessing's "forkserver" start method starts one server process, which imports the
modules in `PRELOAD` and then forks one copy of itself per worker: the copies start in
milliseconds, share the imported pages until they write them, and restart as fast. The server
never runs a worker's code, so each copy starts from a pristine, CUDA-free process, as a spawned
one does (forked.py says what a copy of a *used* process would inherit).

A local run uses it on Linux (`start_method()`); elsewhere, or when it cannot be used, spawn.
The command line starts the server first thing (`start_early`), so its imports run on another
core while the command imports its own.

What a spawned worker inherits from the launcher at the moment it starts - the environment, the
standard streams, the resource limits (the launcher raises `ulimit -n` for its workers), the
cores it may run on, the umask - a copy would take from the server as it was when the server
started. `LauncherState` carries them to the copy, which takes them on (`adopt`) before anything
else. The current directory, sys.path and sys.argv travel by multiprocessing's own preparation
data. What an interpreter reads only as it starts (PYTHONHASHSEED, LD_PRELOAD, OMP_*, ...) cannot
be taken on later: a launch whose such variables differ from the server's stops it and starts a
new one with them (`_ensure_running`). They change in a launcher more often than one would think:
importing scikit-learn sets KMP_* (the digits fallback's did, until it read the file instead), a
one-device run in the launcher sets OMP_NUM_THREADS; had such a launch spawned, so would every
launch after it. The one a launcher's own torch sets to what the server set for itself
(TORCHINDUCTOR_CACHE_DIR, written by torch._dynamo's import) is left out of the comparison.

The server ignores SIGTERM (fork_server_init.py) so that a signal sent to the launcher's whole
process group reaches the launcher, which stops the workers gently, and not the server, whose
death would kill them at once (their parent-death signal, lifeline.die_with_parent). A server
killed alone takes the workers' exit status too; the launcher's line then names it
(`lost_server`), not "exited with code 255" for each worker.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import time
from dataclasses import dataclass, field

from phalanx.atomic import current_umask
from phalanx.runtime.hash_seed import shared_hash_seed
from phalanx.runtime.procs import process_alive

FRESH = "fresh"  # a worker set's start method: forked from the server where it can be, else spawned
# Imported by the server before its first fork: what every worker body needs (torch with them).
PRELOAD = ["phalanx.runtime.fork_server_init", "phalanx.runtime.launch", "phalanx.runtime.script"]
# And for a command whose workers train: torch's compiler front end, which the first torch.optim
# optimizer a process makes imports (2-3 s of one core each on the CI machine). Imported once by the
# server, not by each worker of each launch and restart: `phalanx train`, 1 epoch, 0.94x the wall
# time on 2 workers, 0.80x on 4 (2 cores); a script that makes no optimizer would wait 2 s longer
# for its workers, so `phalanx run` leaves it out. multiprocessing skips a module a torch build lacks.
COMPILER_FRONT_END = "torch._dynamo"
# Read by the interpreter or a library as it loads, so fixed in the server at its start.
_AT_START = ("PYTHON", "LD_", "MALLOC_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "TORCH_", "TORCHDYNAMO_",
             "TORCHINDUCTOR_")
_CACHE_DIR = "TORCHINDUCTOR_CACHE_DIR"
_preload = PRELOAD  # what this process's server imports: start_early's choice
_started_with: tuple[dict[str, str], list[str]] | None = None  # those variables and the preload, at its start


def start_method() -> str:
    """"forkserver" where a server can be used (Linux), else "spawn"."""
    if sys.platform != "linux" or "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    return "forkserver"


def start_early(*, workers_train: bool = False) -> None:
    """Start the server now, so its imports overlap this process's own (the command line's);
    nothing if a launch here could not use it. Never raises: a launch then spawns.
    `workers_train`: the command's workers make an optimizer (COMPILER_FRONT_END above)."""
    global _preload
    _preload = [*PRELOAD, COMPILER_FRONT_END] if workers_train else PRELOAD
    if start_method() == "forkserver":
        with contextlib.suppress(Exception):
            _ensure_running()


def worker_context():
    """The multiprocessing context a local launch starts its workers with, and for a copy of the
    server what it takes on of this process (None for spawn)."""
    if start_method() == "forkserver":
        try:
            _ensure_running()
            return mp.get_context("forkserver"), LauncherState.capture()
        except Exception:  # noqa: BLE001 - no server (a full or read-only temp dir): spawn as before
            pass
    return mp.get_context("spawn"), None


def _ensure_running() -> None:
    """A server that started with this process's start-up variables as they are now, and its
    preload: the running one, or a new one in its place (a launch ends its workers before the
    next one starts, so the stopped server has no copy left to take down)."""
    global _started_with
    from multiprocessing import forkserver

    wanted = (_at_start_variables(), _preload)
    if _started_with is not None and _started_with != wanted:
        _stop(forkserver._forkserver)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_preload)
    with shared_hash_seed("spawn"):  # the server's salt is every copy's: one for the whole run
        forkserver.ensure_running()
    _started_with = wanted


def _stop(server, deadline_s: float = 10.0) -> None:
    """End `server` (multiprocessing's ForkServer): it leaves when its keep-alive pipe closes;
    SIGKILLed if it has not within `deadline_s` (it ignores SIGTERM)."""
    from multiprocessing import util

    with server._lock:
        pid, alive_fd, address = server._forkserver_pid, server._forkserver_alive_fd, server._forkserver_address
        server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None
        if pid is None:
            return
        with contextlib.suppress(OSError):
            os.close(alive_fd)
        if address and not util.is_abstract_socket_namespace(address):
            with contextlib.suppress(OSError):
                os.unlink(address)  # its listening socket's file, in multiprocessing's temp dir
        end = time.monotonic() + deadline_s
        with contextlib.suppress(ChildProcessError):  # reaped already
            while os.waitpid(pid, os.WNOHANG)[0] == 0:
                if time.monotonic() > end:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.01)


def server_pid() -> int | None:
    """The pid of this process's fork server, or None where none was started (or it was stopped)."""
    from multiprocessing import forkserver

    return forkserver._forkserver._forkserver_pid


def lost_server(proc, deadline_s: float = 1.0) -> int | None:
    """The pid of the fork server that started worker `proc` where that server has ended: its
    workers die with it (their parent-death signal) and their exit status, which it carried, is
    lost (multiprocessing reads 255). None for a spawned worker or a server still running."""
    from multiprocessing import popen_forkserver

    if not isinstance(getattr(proc, "_popen", None), popen_forkserver.Popen):
        return None
    pid = server_pid()
    if pid is None:
        return None
    # Its pipes close as it exits, before /proc calls it a zombie: a moment's wait, as a worker's
    # own exit code 255 is read with the server alive. Not reaped here: multiprocessing's own
    # ensure_running waits for it and starts another.
    end = time.monotonic() + deadline_s
    while process_alive(pid):
        if time.monotonic() > end:
            return None
        time.sleep(0.01)
    return pid


def _at_start_variables() -> dict[str, str]:
    with shared_hash_seed("spawn"):
        variables = {name: value for name, value in os.environ.items() if name.startswith(_AT_START)}
    # torch._dynamo's import writes its cache directory into the environment where it is not set:
    # a launcher that made an optimizer since the server started (verify's reference, auto's probe)
    # then holds what the server gave itself, and a restart would import torch again for nothing.
    torch_default = getattr(sys.modules.get("torch._inductor.runtime.cache_dir_utils"), "default_cache_dir", None)
    if torch_default is not None and variables.get(_CACHE_DIR) == os.path.abspath(torch_default()):
        del variables[_CACHE_DIR]
    return variables


def _rebuild_stream(fd: int, df) -> int:
    """In the copy: a standard stream of the launcher's, received as a descriptor, put in place."""
    if df is None:
        with contextlib.suppress(OSError):
            os.close(fd)
        return fd
    received = df.detach()
    if received != fd:
        os.dup2(received, fd)
        os.close(received)
    return fd


class _Stream:
    """One of the launcher's standard streams (0, 1 or 2), sent to the copy as a descriptor."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        try:
            os.fstat(self.fd)
        except OSError:  # closed in the launcher: closed in the worker too, as spawn would leave it
            return _rebuild_stream, (self.fd, None)
        return _rebuild_stream, (self.fd, reduction.DupFd(self.fd))


@dataclass
class LauncherState:
    """What a spawned worker would inherit from the launcher as it starts: `capture()` in the
    launcher, `adopt()` in a forked copy."""

    environ: dict[str, str]
    limits: dict[int, tuple[int, int]]
    cores: set[int] | None
    umask: int
    streams: list = field(default_factory=lambda: [_Stream(fd) for fd in (0, 1, 2)])

    @classmethod
    def capture(cls) -> LauncherState:
        import resource

        limits = {}
        for name in dir(resource):
            if name.startswith("RLIMIT_"):
                with contextlib.suppress(ValueError, OSError):
                    limits[getattr(resource, name)] = resource.getrlimit(getattr(resource, name))
        cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        with shared_hash_seed("spawn"):
            environ = dict(os.environ)
        return cls(environ=environ, limits=limits, cores=cores, umask=current_umask())

    def adopt(self) -> int:
        """In the copy, first: become what a spawned worker would have been (the streams were put
        in place as this object arrived). Returns the server's pid, the copy's parent."""
        import resource

        from phalanx.runtime.fork_server_init import SERVER_PID

        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server's SIG_IGN is not the worker's
        _leave_the_server()
        os.environ.clear()
        os.environ.update(self.environ)
        for which, (soft, hard) in self.limits.items():
            with contextlib.suppress(ValueError, OSError):  # a hard limit above the server's needs root
                resource.setrlimit(which, (soft, hard))
        if self.cores is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, self.cores)
        os.umask(self.umask)
        return SERVER_PID

    def exit(self) -> None:
        """In the copy, last: what a spawned worker's interpreter runs as it exits, which the copy's
        exit (os._exit, multiprocessing's) skips: the atexit handlers, the script's and torch's."""
        import atexit

        atexit._run_exitfuncs()


def _leave_the_server() -> None:
    """Drop the copy's end of the server's keep-alive pipe: the server ends when the launcher does
    (its end then reads EOF), and the workers with it (their parent-death signal). A copy that
    kept it would keep the server, and itself, alive after a SIGKILLed launcher."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    alive_fd = getattr(server, "_forkserver_alive_fd", None)
    if alive_fd is not None:
        with contextlib.suppress(OSError):
            os.close(alive_fd)
        server._forkserver_alive_fd = None
        server._forkserver_address = None  # a forkserver this worker needs is its own
