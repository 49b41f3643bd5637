"""A small task graph and the schedulers that run it: in sequence, or dependency-driven on lanes.

D2L's "Automatic Parallelism" says a framework's backend builds a dependency graph and runs
whatever is ready. This is that idea made visible: a `TaskGraph` of named `Task`s, each with the
tasks it depends on and the *lane* it runs on (a device, or the host). `run_in_sequence` runs a
topological order on the calling thread; `run_on_lanes` gives each lane one thread (a CPU
"device": one thing at a time, `intra_op_threads` cores of its own) and submits each task to
its lane the moment its last dependency finishes (futures, completion callbacks). The streams +
events version for CUDA lives in autopar_cuda.py. Every run returns a `Schedule` (each task's
lane, start and end), which `violations` checks against every declared edge, and whose
durations give the graph's `critical_path`, the ideal a scheduler is measured against.
What this does not know: what the tasks compute, or whether the declared edges are the true ones
(a task reading data another task writes must declare it; the tests plant a missing edge).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import torch
from torch.profiler import record_function


@dataclass(frozen=True, kw_only=True)
class Task:
    name: str
    fn: Callable[[], None]
    lane: str
    deps: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Span:
    lane: str
    start_s: float  # since the run began
    end_s: float


@dataclass
class Schedule:
    """What a run did: task name -> Span, in completion order."""

    spans: dict[str, Span] = field(default_factory=dict)

    def durations_s(self) -> dict[str, float]:
        return {name: span.end_s - span.start_s for name, span in self.spans.items()}


class TaskGraph:
    """Tasks by name, validated: unique names, known dependencies, no cycle."""

    def __init__(self, tasks: Iterable[Task]) -> None:
        self.tasks: dict[str, Task] = {}
        for task in tasks:
            if task.name in self.tasks:
                raise ValueError(f"task {task.name!r} is defined twice")
            self.tasks[task.name] = task
        for task in self.tasks.values():
            unknown = [d for d in task.deps if d not in self.tasks]
            if unknown:
                raise ValueError(f"task {task.name!r} depends on unknown task(s) {unknown}")
        self.order = self._topological_order()
        self.dependents: dict[str, list[str]] = {name: [] for name in self.tasks}
        for task in self.tasks.values():
            for dep in dict.fromkeys(task.deps):  # a repeated dependency is one edge
                self.dependents[dep].append(task.name)

    def _topological_order(self) -> list[str]:
        # Kahn's algorithm, stable: among ready tasks the one defined first runs first.
        waiting = {name: len(set(task.deps)) for name, task in self.tasks.items()}
        users: dict[str, list[str]] = {name: [] for name in self.tasks}
        for task in self.tasks.values():
            for dep in set(task.deps):
                users[dep].append(task.name)
        position = {name: i for i, name in enumerate(self.tasks)}
        ready = sorted((n for n, w in waiting.items() if w == 0), key=position.__getitem__)
        order: list[str] = []
        while ready:
            name = ready.pop(0)
            order.append(name)
            for user in users[name]:
                waiting[user] -= 1
                if waiting[user] == 0:
                    ready.append(user)
                    ready.sort(key=position.__getitem__)
        if len(order) != len(self.tasks):
            stuck = sorted(set(self.tasks) - set(order))
            raise ValueError(f"the graph has a cycle through {stuck}")
        return order

    @property
    def edges(self) -> list[tuple[str, str]]:
        return [(dep, task.name) for task in self.tasks.values() for dep in task.deps]

    @property
    def lanes(self) -> list[str]:
        return list(dict.fromkeys(task.lane for task in self.tasks.values()))

    def check_order(self, order: Sequence[str]) -> None:
        """ValueError unless `order` runs every task once, each after all of its dependencies."""
        if sorted(order) != sorted(self.tasks):
            raise ValueError(f"an order must name each of the {len(self.tasks)} tasks once, got {len(order)}")
        seen: set[str] = set()
        for name in order:
            missing = [d for d in self.tasks[name].deps if d not in seen]
            if missing:
                raise ValueError(f"task {name!r} comes before its dependencies {missing}")
            seen.add(name)


def trace_label(task: Task) -> str:
    """How a task is named in a profiler trace: its name and, after an @, its lane."""
    return f"{task.name} @{task.lane}"


def critical_path(graph: TaskGraph, durations_s: Mapping[str, float]) -> tuple[float, list[str]]:
    """The longest chain of dependent tasks and its length: no scheduler can finish sooner."""
    finish: dict[str, float] = {}
    via: dict[str, str | None] = {}
    for name in graph.order:
        deps = graph.tasks[name].deps
        before = max(deps, key=finish.__getitem__) if deps else None
        finish[name] = (finish[before] if before else 0.0) + durations_s[name]
        via[name] = before
    if not finish:
        return 0.0, []
    last: str | None = max(finish, key=finish.__getitem__)
    length, path = finish[last], []
    while last is not None:
        path.append(last)
        last = via[last]
    return length, path[::-1]


def bounds(graph: TaskGraph, durations_s: Mapping[str, float]) -> dict[str, float]:
    """What no scheduler can beat with these durations: the critical path, the busiest lane's
    total (a lane runs one task at a time), and the ideal, the larger of the two."""
    path_s, _ = critical_path(graph, durations_s)
    per_lane: dict[str, float] = {}
    for name, task in graph.tasks.items():
        per_lane[task.lane] = per_lane.get(task.lane, 0.0) + durations_s[name]
    busiest_s = max(per_lane.values(), default=0.0)
    return {"critical_path_s": path_s, "busiest_lane_s": busiest_s, "ideal_s": max(path_s, busiest_s)}


def compare_runs(graph: TaskGraph, alone: Schedule, side_by_side: Schedule) -> dict[str, float]:
    """The ideal from a sequential run's task durations, and what a concurrent run lost to: the same
    ideal with the durations the tasks had side by side (the gap to it is time between tasks:
    waiting, handing over) and how much slower the tasks themselves ran (shared cores, memory)."""
    alone_s, crowded_s = alone.durations_s(), side_by_side.durations_s()
    return {**bounds(graph, alone_s), "ideal_side_by_side_s": bounds(graph, crowded_s)["ideal_s"],
            "task_slowdown": sum(crowded_s.values()) / max(sum(alone_s.values()), 1e-12)}


def violations(graph: TaskGraph, schedule: Schedule, *, edges: Iterable[tuple[str, str]] | None = None) -> list[str]:
    """Every edge (a -> b) for which b started before a ended, or a task that never ran."""
    found = [f"{name} never ran" for name in graph.tasks if name not in schedule.spans]
    for before, after in graph.edges if edges is None else edges:
        a, b = schedule.spans.get(before), schedule.spans.get(after)
        if a is not None and b is not None and b.start_s < a.end_s:
            found.append(f"{after} started {1e3 * (a.end_s - b.start_s):.3f} ms before {before} ended")
    return found


def run_in_sequence(graph: TaskGraph, *, order: Sequence[str] | None = None,
                    after_each: Callable[[], None] | None = None) -> Schedule:
    """Run the tasks one after another on this thread (`order`: another topological order)."""
    if order is not None:
        graph.check_order(order)
    schedule, t0 = Schedule(), time.perf_counter()
    for name in graph.order if order is None else order:
        task = graph.tasks[name]
        start_s = time.perf_counter() - t0
        with record_function(trace_label(task)):
            task.fn()
        if after_each is not None:
            after_each()  # e.g. cuda.synchronize, so the span covers the work, not its launch
        schedule.spans[name] = Span(lane=task.lane, start_s=start_s, end_s=time.perf_counter() - t0)
    return schedule


class ThreadLanes:
    """One single-thread executor per lane, each thread using `intra_op_threads` cores for its ops."""

    def __init__(self, names: Sequence[str], *, intra_op_threads: int = 1) -> None:
        if intra_op_threads < 1:
            raise ValueError(f"intra_op_threads must be at least 1, got {intra_op_threads}")
        self.intra_op_threads = intra_op_threads
        self._executors = {name: ThreadPoolExecutor(1, thread_name_prefix=f"lane-{name}") for name in names}

    @property
    def names(self) -> list[str]:
        return list(self._executors)

    def submit(self, lane: str, fn: Callable[[], object]) -> Future:
        if lane not in self._executors:
            raise ValueError(f"no lane {lane!r}; lanes are {self.names}")
        return self._executors[lane].submit(self._on_lane, fn)

    def _on_lane(self, fn: Callable[[], object]) -> object:
        # The intra-op setting is per thread (OpenMP, MKL's local count): set it where the ops run.
        if torch.get_num_threads() != self.intra_op_threads:
            torch.set_num_threads(self.intra_op_threads)
        return fn()

    def run_all(self, work: Mapping[str, Callable[[], object]], *, deadline_s: float) -> dict[str, object]:
        """Run one callable per lane at once; their results by lane, within the deadline."""
        futures = {lane: self.submit(lane, fn) for lane, fn in work.items()}
        end = time.monotonic() + deadline_s
        return {lane: future.result(timeout=max(0.0, end - time.monotonic())) for lane, future in futures.items()}

    def close(self) -> None:
        for executor in self._executors.values():
            executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "ThreadLanes":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_on_lanes(graph: TaskGraph, lanes: ThreadLanes, *, deadline_s: float) -> Schedule:
    """Dependency-driven: each task goes to its lane's thread as soon as its dependencies are done."""
    missing = sorted(set(graph.lanes) - set(lanes.names))
    if missing:
        raise ValueError(f"the graph uses lanes {missing} that were not started")
    schedule, lock, finished = Schedule(), threading.Lock(), threading.Event()
    waiting = {name: len(set(task.deps)) for name, task in graph.tasks.items()}
    errors: list[BaseException] = []
    t0 = time.perf_counter()

    def timed(task: Task) -> Callable[[], Span]:
        def run() -> Span:
            start_s = time.perf_counter() - t0
            with record_function(trace_label(task)):
                task.fn()
            return Span(lane=task.lane, start_s=start_s, end_s=time.perf_counter() - t0)
        return run

    def submit(name: str) -> None:
        future = lanes.submit(graph.tasks[name].lane, timed(graph.tasks[name]))
        future.add_done_callback(lambda f, name=name: done(name, f))

    def done(name: str, future: Future) -> None:
        # Runs on the finishing lane's thread; the lock makes "last dependency done" happen once.
        if future.exception() is not None:
            errors.append(future.exception())
            finished.set()
            return
        ready = []
        with lock:
            schedule.spans[name] = future.result()
            for user in graph.dependents[name]:
                waiting[user] -= 1
                if waiting[user] == 0:
                    ready.append(user)
            if len(schedule.spans) == len(graph.tasks):
                finished.set()
        for user in ready:
            submit(user)

    roots = [name for name in graph.order if waiting[name] == 0]
    for name in roots:
        submit(name)
    if not graph.tasks:
        return schedule
    if not finished.wait(deadline_s):
        pending = sorted(set(graph.tasks) - set(schedule.spans))
        raise RuntimeError(f"task graph not done after {deadline_s:g} s; still pending: {pending[:8]}")
    if errors:
        raise errors[0]
    return schedule
