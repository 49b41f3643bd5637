"""The two exception types whose message is the whole story, so the terminal shows no traceback.

`UsageError`: the user gave us something we cannot use; one line naming the problem and the
fix, exit code 2 (see `phalanx.cli`). `RunFailed`: a run stopped on a condition phalanx checks
for (a NaN loss, replicas that drifted apart); one line naming the step, the rank and what to
try, exit code 1. Every other exception is a bug or an environment failure and keeps its
traceback.
"""


class UsageError(Exception):
    """Bad input: the message names the problem and the fix, in one line."""

    exit_code = 2


class RunFailed(RuntimeError):
    """A checked condition stopped the run; the message names step, rank and the fix, in one line."""

    exit_code = 1


class PhalanxWarning(UserWarning):
    """A run that trains, but not as written means (silence with warnings.filterwarnings)."""


class Stopped(BaseException):
    """The launcher was told to stop (SIGTERM from `timeout`, a scheduler, a container stop, or
    SIGHUP); its workers have been taken down. A BaseException, like KeyboardInterrupt, so no
    `except Exception` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        import signal

        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")
