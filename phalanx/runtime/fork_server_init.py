"""Imported by the fork server alone, first (fork_server.PRELOAD): it ignores SIGTERM, so a signal
sent to the launcher's whole process group stops the workers through the launcher, gently,
instead of ending the server and the workers with it. `SERVER_PID` is the server's process id,
which each copy inherits: the parent its parent-death signal belongs to (lifeline.die_with_parent).

The server leaves without the interpreter's teardown: once its launcher has gone (its keep-alive
pipe closed) it flushes its streams and exits at once. Tearing down torch and torch._dynamo's
modules took 0.64 s of a core on the 2-core CI machine (`import torch, torch._dynamo`: 3.75 s,
3.16 s with an `os._exit(0)` at its end), during which the server still held the launcher's
stdout and stderr, so whatever read them to their end (a pipe into `tee`, a test's
`subprocess.run`) waited that long after the launcher had exited. The server never runs a
worker's code (each copy leaves by multiprocessing's own `os._exit`), so nothing of a run's is
left to flush or close in it.
Nothing else imports this module: in any other process the import would ignore SIGTERM there.
"""

import atexit
import os
import signal
import sys

SERVER_PID = os.getpid()
signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _leave_at_once() -> None:
    """The server's atexit call: flush and end, skipping the teardown of every imported module (an
    exception that ended the server still exits 1). Registered before torch's handlers, so after
    them; multiprocessing's own, registered before it, has nothing to do in the server (no
    finalizers, no Process children: it forks with os.fork). A copy inherits the registration and
    runs the atexit handlers as a spawned worker would (LauncherState.exit): there it does nothing."""
    if os.getpid() != SERVER_PID:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stream: nothing left to say on it
            pass
    failed = getattr(sys, "last_value", None)
    os._exit(1 if failed is not None and not isinstance(failed, SystemExit) else 0)


atexit.register(_leave_at_once)
