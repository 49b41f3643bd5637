"""Run one command again and again until a run overruns, then record what every process it
started is doing: for a hang that shows up once in a hundred runs, where the run's own error says
only that a rank sat outside any collective. It found why a DataLoader worker of a `phalanx run`
rank hung at its start (2026-12-05: a lock copied held by its fork, runtime/fork_guard.py).

    .venv/bin/python tools/hunt_hang.py --runs 200 --stuck-after 35 --out /tmp/hunt -- \\
        .venv/bin/python -m phalanx run --devices cpu:2 --timeout 90 SCRIPT ARGS

Each run's stderr is kept (`<out>/stderr-<n>.txt`) where it failed (exit code not 0) or overran. A run still going after
`--stuck-after` seconds has its process tree (from `ps`, by parent pid) written to
`<out>/stuck-<n>.txt`: every process's state and kernel wait channel, SIGUSR1 sent to each
process of the run that catches it (a script that calls `faulthandler.register(signal.SIGUSR1,
all_threads=True)`, as the DataLoader workers it forks then do too, prints every thread's Python
stack; a process that does not catch it is left alone, SIGUSR1 would end it), and each
process's native stacks from gdb, the deepest first (the launcher's are the least telling, and
gdb takes seconds a process). Run several at once beside a CPU burner (`yes >
/dev/null`) to make a race likelier.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def _tree(root: int) -> tuple[str, list[int]]:
    """`ps`'s view of every process, and `root` with its descendants, parents first."""
    table = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,stat=,wchan:32=,args="], capture_output=True,
                           text=True, timeout=30).stdout
    children: dict[int, list[int]] = {}
    for line in table.splitlines():
        pid, ppid = (int(x) for x in line.split()[:2])
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        found.append(pid)
        todo += children.get(pid, [])
    return table, found


def _catches_sigusr1(pid: int) -> bool:
    """Whether `pid` has a handler for SIGUSR1 (its SigCgt mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(mask >> (signal.SIGUSR1 - 1) & 1)


def _record(run: subprocess.Popen, where: Path) -> None:
    table, tree = _tree(run.pid)
    catching = [pid for pid in tree if _catches_sigusr1(pid)]
    with where.open("w") as out:
        out.write(f"process tree of pid {run.pid}: {tree}\nSIGUSR1 sent to: {catching}\n\n{table}\n")
        out.flush()
        for pid in catching:
            os.kill(pid, signal.SIGUSR1)  # the Python stacks go to the run's stderr
        for pid in tree[::-1]:  # the deepest first
            out.write(f"==== pid {pid}\n")
            out.flush()
            subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 25"], stdout=out,
                           stderr=subprocess.STDOUT, timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--stuck-after", type=float, default=35.0, help="seconds after which a run is recorded")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    args.out.mkdir(parents=True, exist_ok=True)
    for n in range(args.runs):
        started = time.monotonic()
        stderr_path = args.out / f"stderr-{n}.txt"
        with stderr_path.open("w") as stderr:  # a file: a hung run's stack dumps cannot fill a pipe
            run = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
        recorded = False
        while run.poll() is None:
            time.sleep(0.5)
            if not recorded and time.monotonic() - started > args.stuck_after:
                recorded = True
                _record(run, args.out / f"stuck-{n}.txt")
        if not (run.returncode or recorded):
            stderr_path.unlink()
        print(f"run {n}: exit {run.returncode} after {time.monotonic() - started:.1f} s"
              f"{' (recorded)' if recorded else ''}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
