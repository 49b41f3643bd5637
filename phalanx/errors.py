"""The one exception type that means "the user gave us something we cannot use".

Anything raised as `UsageError` reaches the terminal as a single line naming the problem and the
fix, with exit code 2 and no traceback (see `phalanx.cli`). Every other exception is a bug or an
environment failure and keeps its traceback.
"""


class UsageError(Exception):
    """Bad input: the message names the problem and the fix, in one line."""

    exit_code = 2
