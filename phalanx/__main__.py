"""The `phalanx` command's entry point (`phalanx ...` and `python -m phalanx ...`, which is what
`torchrun -m phalanx train` runs in every process).

It installs the stop handlers (phalanx.runtime.lifeline) before anything slow is imported, so a Ctrl-C or
a SIGTERM in the first second - while torch loads - ends in one line and the usual exit code
instead of a traceback; `phalanx/__init__.py` imports nothing heavy for the same reason.
"""

import os
import sys

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


if __name__ == "__main__":
    raise SystemExit(main())
