"""Imported by the fork server alone, first (fork_server.PRELOAD): it ignores SIGTERM, so a signal
sent to the launcher's whole process group stops the workers through the launcher, gently,
instead of ending the server and the workers with it. `SERVER_PID` is the server's process id,
which each copy inherits: the parent its parent-death signal belongs to (lifeline.die_with_parent).
Nothing else imports this module: in any other process the import would ignore SIGTERM there.
"""

import os
import signal

SERVER_PID = os.getpid()
signal.signal(signal.SIGTERM, signal.SIG_IGN)
