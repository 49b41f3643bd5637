"""The `phalanx` command's entry point (`phalanx ...` and `python -m phalanx ...`, which is what
`torchrun -m phalanx train` runs in every process).

It installs the stop handlers (phalanx.runtime.lifeline) before anything slow is imported, so a Ctrl-C or
a SIGTERM in the first second - while torch loads - ends in one line and the usual exit code
instead of a traceback; `phalanx/__init__.py` imports nothing heavy for the same reason. It ends
without the interpreter's teardown (`console`) where no script of the user's ran in this process.
"""

import atexit
import os
import sys
import threading
from typing import NoReturn

from phalanx.errors import Stopped
from phalanx.runtime.lifeline import ignore_stops_if_stopping, install_stop_handlers, stop_message


def main() -> int:
    # Under torchrun this process is a worker that SIGTERM (torchrun's way to stop its workers)
    # should end at once, as by default; the stop handlers are for a process with workers of its
    # own to take down. (RANK and WORLD_SIZE decide, as in world.launcher_env, read here without
    # importing torch.)
    torchrun_worker = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    install_stop_handlers(interrupt_only=torchrun_worker)
    try:
        from phalanx.cli import main as run_command

        return run_command()
    except (KeyboardInterrupt, Stopped) as exc:  # while phalanx.cli and torch load; later, cli.main's
        line, code = stop_message(exc)
        print(line, file=sys.stderr)
        return code
    finally:
        ignore_stops_if_stopping()


def console() -> NoReturn:
    """The command itself (its console script, `python -m phalanx`): `main()`, then the exit. A
    torchrun worker exits as Python does, since `phalanx run` runs the user's script in it (an
    unclosed file of theirs is flushed by the teardown). Anywhere else this process ran phalanx's
    code alone - a launcher, or `train` on one device - so it ends as the interpreter would,
    non-daemon threads joined and atexit handlers run (logging's, multiprocessing's, tempfile's
    finalizers), without tearing down every module torch and torch._dynamo loaded: 0.3-0.6 s of
    each command's end, during which a pipe reading its output (`| tee`, a test's capture) waited."""
    code = main()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        sys.exit(code)
    for thread in threading.enumerate():  # what the interpreter waits for before the atexit handlers
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stream: nothing left to say on it
            pass
    os._exit(code)


if __name__ == "__main__":
    console()
