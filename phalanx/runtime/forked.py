"""Workers started by fork: what a forked worker must not take over from the process it copies.

`phalanx.launch(fn, ...)` forks its workers by default on Linux (runtime/function_launch.py says
why: a function defined in a notebook cannot be imported by a fresh interpreter). A forked worker
is a copy of the launching process at the fork, with one thread. Three things of that process
would break it, and are dealt with here:

- OpenMP. GNU libgomp (PyTorch's Linux wheels ship it) keeps its thread pool in the state of the
  thread that opened it, and a fork copies that state but not the pool's threads. The first
  parallel region the worker's main thread then opens with more than one thread waits for them
  forever: measured, 2 forked workers with 2 threads each hung at their first matmul once the
  launching process had run one (with 1 thread each they ran). A thread started in the worker has
  no pool yet and opens its own: the worker's whole body runs on one (`on_fresh_thread`).
- The launcher's signal handlers (a stop raises an exception meant for the launcher): the worker
  gets Python's defaults back (`reset_signals`), as a fresh interpreter has them.
- A CUDA context or a process group open in the launching process cannot be used by a copy:
  refused before anything is forked, in one line naming the fix (`check_forkable`).

And one thing a copy should take over: the modules the function will import. A forked worker
inherits the launching process's imports, but what it imports itself dies with it, so a module
the launching process never loaded is imported again by every worker of every launch
(`warm_imports` loads them here, once).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import signal
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from phalanx.errors import UsageError
from phalanx.public_names import OWNERS
from phalanx.runtime.lifeline import signals_deferred, stop_on_signals

START_METHODS = ("fork", "spawn")


def check_forkable(*, device_kind: str) -> None:
    """Refuse, before any fork, a launching process whose copies could not run the workers."""
    if dist.is_available() and dist.is_initialized():
        raise UsageError("launch() forks this process, which has a torch.distributed process group open that its "
                         "copies cannot use; call torch.distributed.destroy_process_group() first (each worker "
                         "joins its own through phalanx.init()), or pass start_method='spawn'")
    if device_kind == "cuda" and torch.cuda.is_initialized():
        raise UsageError("launch() on GPUs forks this process, in which CUDA is already initialized (something was "
                         "put on a GPU here), and a forked worker cannot use CUDA then; restart the interpreter (the "
                         "notebook's kernel) and create every CUDA tensor inside the function, or define the "
                         "function in a module and pass start_method='spawn'")


def reset_signals() -> None:
    """Python's own handlers for the stop signals, in place of those the launcher had installed."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def on_fresh_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` on a thread started here, waited for; its result, or its exception re-raised.

    The main thread waits for it, where a signal still reaches its handlers (SIGTERM's flush,
    runtime/lifeline.py); a Ctrl-C, which Python raises there, is handed on to `fn`'s thread, so its
    own `except KeyboardInterrupt:` runs (an emergency save), as on a spawned worker's main thread.
    The thread is not a daemon: the worker exits once it has returned."""
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            outcome["result"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            outcome["error"] = exc
        done.set()

    thread = threading.Thread(target=run, name="phalanx-worker-main")
    thread.start()
    # Waited on through the event, not `join`: Python 3.11's join, cut by a KeyboardInterrupt, can
    # leave the thread marked dead while it runs (bpo-45274), and the worker would not wait for it.
    while thread.is_alive() and not done.is_set():
        try:
            done.wait(0.5)
        except KeyboardInterrupt:  # raised in fn's thread at its next bytecode (after a C call returns)
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                       ctypes.py_object(KeyboardInterrupt))
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    if "result" not in outcome:  # the handed-on Ctrl-C landed outside fn, past its own handling
        raise KeyboardInterrupt
    return outcome["result"]


def warm_imports() -> None:
    """Import here, before forking, what a worker's function imports on first use: the modules behind
    the public API (public_names.py's table; phalanx/__init__.py loads each on first use) and torch's compiler front end, which
    the first torch.optim optimizer a process constructs imports. Each worker of each launch imported
    them anew (torch._dynamo alone 3.1 s): a 4-step MLP launched on 2 workers from a session that had
    made no optimizer took 4.9-7.5 s every time on 2 cores; imported here once, 0.24-0.47 s after the
    first (3.7-4.7 s, which pays them). A Ctrl-C is held until they are whole: one that cut an import
    short left half-made modules behind (sympy without `core`), and every later launch in the session
    failed on them."""
    with stop_on_signals(), signals_deferred():
        for module in sorted(set(OWNERS.values())):
            importlib.import_module(module)
        with contextlib.suppress(ImportError):  # a torch build without it: the workers import nothing more
            import torch._dynamo  # noqa: F401
