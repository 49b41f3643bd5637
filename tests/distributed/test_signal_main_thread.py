"""A stop the launcher forwards reaches each worker's main thread: Python runs signal handlers
there only, and a signal sent to the process as a whole may be taken by another thread (gloo's,
the communication thread; none block signals), leaving a main thread asleep in a system call
asleep. A script's `time.sleep(600)` then got its Ctrl-C only when the sleep ended, after the
launcher's grace, and its `except KeyboardInterrupt:` save never ran (one rank in a full run of
the suite, 2026-12-03)."""

import os
import signal
import subprocess
import sys

import pytest

from phalanx.runtime.lifeline import signal_main_thread

pytestmark = pytest.mark.distributed

# The main thread blocks SIGINT, so a signal sent to the process goes to the other thread, which
# blocks nothing (as gloo's threads); one sent to the main thread waits there for sigtimedwait.
WAITS_ON_MAIN_THREAD = """
import signal, threading, time
signal.signal(signal.SIGINT, lambda *_: None)
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
print("ready", flush=True)
time.sleep(0.5)  # the other thread has taken a signal sent to the process by now
print("main thread got it" if signal.sigtimedwait({signal.SIGINT}, 5) else "main thread did not", flush=True)
"""


@pytest.mark.parametrize("send", ["signal_main_thread", "os.kill"])
def test_a_forwarded_stop_reaches_the_main_thread(send):
    child = subprocess.Popen([sys.executable, "-c", WAITS_ON_MAIN_THREAD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        (signal_main_thread if send == "signal_main_thread" else os.kill)(child.pid, signal.SIGINT)
        said = child.stdout.readline().strip()
    finally:
        child.kill()
        child.wait(10)
    # os.kill, what the launcher used before: the process's other thread took it.
    assert said == ("main thread got it" if send == "signal_main_thread" else "main thread did not")


def test_a_signal_to_a_process_that_is_gone_is_an_oserror():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(30)
    with pytest.raises(ProcessLookupError):
        signal_main_thread(child.pid, signal.SIGINT)
