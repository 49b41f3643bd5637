"""A task graph derived from a sequential program's reads and writes, and a run-time hazard check.

This is how the chapter's frameworks find parallelism (MXNet's dependency engine, PyTorch's
CUDA streams within one stream's order): the user writes a program one statement after another;
each statement says which buffers it reads and which it writes; an edge goes from a statement
to a later one whenever running them the other way round could change a result - read after
write, write after read, write after write on the same buffer. Everything else may run at once.
`program_graph(steps)` builds that `TaskGraph`; its first topological order is the program order.

`HazardCheck(steps)` is the check that a schedule honoured those dependencies, made while it
runs and independent of the edges the scheduler was given: every buffer carries a version (the
number of writes so far), and each task, when it starts, must see exactly the versions the
program order implies, and when it writes, every reader of the version it overwrites must have
finished. A schedule that ran a task too early (say, one whose edge was lost) is caught here
whatever else happened to come out right.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Sequence

from phalanx.autopar.taskgraph import Task, TaskGraph


@dataclass(frozen=True, kw_only=True)
class Step:
    name: str
    fn: Callable[[], None]
    lane: str
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()


def program_graph(steps: Sequence[Step], *, wrap: Callable[[Step], Callable[[], None]] | None = None) -> TaskGraph:
    """The dependency graph of `steps` in program order (RAW, WAR and WAW edges)."""
    last_writer: dict[str, str] = {}
    readers_since_write: dict[str, list[str]] = {}
    tasks = []
    for step in steps:
        deps: list[str] = []
        for buffer in step.reads:
            if buffer in last_writer:
                deps.append(last_writer[buffer])  # read after write
        for buffer in step.writes:
            if buffer in last_writer:
                deps.append(last_writer[buffer])  # write after write
            deps.extend(r for r in readers_since_write.get(buffer, []) if r != step.name)  # write after read
        for buffer in step.reads:
            readers_since_write.setdefault(buffer, []).append(step.name)
        for buffer in step.writes:
            last_writer[buffer] = step.name
            readers_since_write[buffer] = []
        tasks.append(Task(name=step.name, lane=step.lane, fn=step.fn if wrap is None else wrap(step),
                          deps=tuple(dict.fromkeys(d for d in deps if d != step.name))))
    return TaskGraph(tasks)


class HazardCheck:
    """Wraps each step so that running it checks the versions it sees; `problems` lists violations."""

    def __init__(self, steps: Sequence[Step]) -> None:
        self.steps = list(steps)
        self._lock = threading.Lock()
        writes_so_far: dict[str, int] = {}
        reads_of: dict[tuple[str, int], int] = {}  # (buffer, version) -> how many steps read it
        self._expect: dict[str, dict[str, int]] = {}  # step -> buffer -> version it must see
        for step in self.steps:
            seen = {b: writes_so_far.get(b, 0) for b in (*step.reads, *step.writes)}
            self._expect[step.name] = seen
            for buffer in dict.fromkeys(step.reads):
                reads_of[(buffer, seen[buffer])] = reads_of.get((buffer, seen[buffer]), 0) + 1
            for buffer in dict.fromkeys(step.writes):
                writes_so_far[buffer] = writes_so_far.get(buffer, 0) + 1
        self._readers_expected = reads_of
        self.reset()

    def reset(self) -> None:
        self.version: dict[str, int] = {}
        self.finished_reads: dict[tuple[str, int], int] = {}
        self.problems: list[str] = []

    def wrap(self, step: Step) -> Callable[[], None]:
        def run() -> None:
            self._enter(step)
            step.fn()
            self._leave(step)
        return run

    def _enter(self, step: Step) -> None:
        with self._lock:
            for buffer, want in self._expect[step.name].items():
                have = self.version.get(buffer, 0)
                if have != want:
                    self.problems.append(f"{step.name} found {buffer} at version {have}, program order says {want}")
            for buffer in dict.fromkeys(step.writes):
                version = self._expect[step.name][buffer]
                pending = (self._readers_expected.get((buffer, version), 0)
                           - self.finished_reads.get((buffer, version), 0)
                           - (1 if buffer in step.reads else 0))
                if pending > 0:
                    self.problems.append(
                        f"{step.name} overwrote {buffer} while {pending} reader(s) of it had not finished")

    def _leave(self, step: Step) -> None:
        with self._lock:
            for buffer in dict.fromkeys(step.reads):
                key = (buffer, self._expect[step.name][buffer])
                self.finished_reads[key] = self.finished_reads.get(key, 0) + 1
            for buffer in dict.fromkeys(step.writes):
                self.version[buffer] = self.version.get(buffer, 0) + 1

    def graph(self) -> TaskGraph:
        """The program's graph with every task wrapped by this check."""
        return program_graph(self.steps, wrap=self.wrap)
