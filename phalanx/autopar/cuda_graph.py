"""Experiment 5 on a GPU: the MLP's task graph run with CUDA streams and events.

The CUDA form of taskgraph.run_on_lanes. Device lanes are CUDA streams (on cuda:0 and cuda:1
when there are two GPUs, else two streams of cuda:0); the host lane is this thread. One pass over
a topological order that launches every ready GPU task before it runs a host task (a host task
blocks; the GPU should have its queue full by then): a GPU task first makes its stream wait on
the events of its dependencies on other streams, then records start and end events around its
kernels; a host task first waits (with a deadline) for the end events of its GPU dependencies,
then runs. A GPU task depending on a host task is launched after it ran, so that edge holds by
construction. The schedule's GPU spans come from the events, host spans from the host clock;
`violations` is checked on the edges whose two ends share a clock (host, or one GPU's events).

The measurement mirrors autopar_deps.py: strictly in sequence (program order on the current
stream, a synchronize after every task, which also times each task for the critical path)
against the scheduler; the check is the final weights, bitwise.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from phalanx.autopar.cuda import wait_event
from phalanx.autopar.graphs import HOST, MLPProgram
from phalanx.autopar.trace import profiled
from phalanx.autopar.taskgraph import Schedule, Span, TaskGraph, compare_runs, run_in_sequence, trace_label, violations
from phalanx.autopar.taskgraph_program import program_graph
from phalanx.measure.timing import run_interleaved, synchronize_cuda



def launch_order(graph: TaskGraph, host_lanes: set[str]) -> list[str]:
    """A topological order that takes every ready device task before any ready host task."""
    waiting = {name: len(set(task.deps)) for name, task in graph.tasks.items()}
    position = {name: i for i, name in enumerate(graph.order)}
    ready = [name for name in graph.order if waiting[name] == 0]
    order = []
    while ready:
        ready.sort(key=lambda n: (graph.tasks[n].lane in host_lanes, position[n]))
        name = ready.pop(0)
        order.append(name)
        for user in graph.dependents[name]:
            waiting[user] -= 1
            if waiting[user] == 0:
                ready.append(user)
    return order


def run_on_streams(graph: TaskGraph, streams: dict[str, torch.cuda.Stream | None], *,
                   deadline_s: float) -> tuple[Schedule, list[tuple[str, str]]]:
    """Launch the graph; return its schedule and the edges whose ends share a clock (to check)."""
    host_lanes = {lane for lane, stream in streams.items() if stream is None}
    synchronize_cuda()
    origins = {}  # elapsed_time needs two events of one device: one origin per device
    for stream in streams.values():
        if stream is not None and stream.device not in origins:
            origins[stream.device] = torch.cuda.Event(enable_timing=True)
            origins[stream.device].record(torch.cuda.current_stream(stream.device))
    t0 = time.perf_counter()
    end = time.monotonic() + deadline_s
    marks: dict[str, tuple[torch.cuda.Event, torch.cuda.Event]] = {}
    schedule = Schedule()
    for name in launch_order(graph, host_lanes):
        task = graph.tasks[name]
        stream = streams[task.lane]
        gpu_deps = [d for d in task.deps if d in marks]
        if stream is None:
            for dep in gpu_deps:
                wait_event(marks[dep][1], deadline_s=max(0.0, end - time.monotonic()))
            start_s = time.perf_counter() - t0
            with torch.profiler.record_function(trace_label(task)):
                task.fn()
            schedule.spans[name] = Span(lane=task.lane, start_s=start_s, end_s=time.perf_counter() - t0)
            continue
        for dep in gpu_deps:
            if streams[graph.tasks[dep].lane] is not stream:
                stream.wait_event(marks[dep][1])  # same stream: its order already holds
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream), torch.profiler.record_function(trace_label(task)):
            before.record(stream)
            task.fn()
            after.record(stream)
        marks[name] = (before, after)
    synchronize_cuda()
    for name, (before, after) in marks.items():
        origin = origins[streams[graph.tasks[name].lane].device]
        schedule.spans[name] = Span(lane=graph.tasks[name].lane, start_s=origin.elapsed_time(before) / 1e3,
                                    end_s=origin.elapsed_time(after) / 1e3)

    def clock(name: str):
        stream = streams[graph.tasks[name].lane]
        return "host" if stream is None else stream.device
    same_clock = [(a, b) for a, b in graph.edges if clock(a) == clock(b)]
    return schedule, same_clock


def _devices() -> tuple[torch.device, torch.device]:
    if torch.cuda.device_count() >= 2:
        return torch.device("cuda:0"), torch.device("cuda:1")
    return torch.device("cuda:0"), torch.device("cuda:0")


def measure_cuda_mlp(*, batch_size: int, in_features: int, hidden: int, out_features: int, steps: int, rounds: int,
                     dtype: str, deadline_s: float, trace_dir: str | None = None) -> dict[str, Any]:
    devices = _devices()
    program = MLPProgram(batch_size=batch_size, in_features=in_features, hidden=hidden, out_features=out_features,
                         steps=steps, dtype=getattr(torch, dtype), devices=devices)
    graph = program_graph(program.program())
    streams = {"device0": torch.cuda.Stream(device=devices[0]), "device1": torch.cuda.Stream(device=devices[1]),
               HOST: None}
    schedules: dict[str, list[Schedule]] = {"in sequence": [], "scheduled": []}
    checked_edges: list[list[str]] = []

    def in_sequence() -> float:
        program.reset()
        synchronize_cuda()
        start_s = time.perf_counter()
        schedules["in sequence"].append(run_in_sequence(graph, after_each=synchronize_cuda))
        return time.perf_counter() - start_s

    def scheduled() -> float:
        program.reset()
        synchronize_cuda()
        start_s = time.perf_counter()
        schedule, same_clock = run_on_streams(graph, streams, deadline_s=deadline_s)
        elapsed_s = time.perf_counter() - start_s
        schedules["scheduled"].append(schedule)
        checked_edges.append(violations(graph, schedule, edges=same_clock))
        return elapsed_s

    samples = run_interleaved({"in sequence": in_sequence, "scheduled": scheduled}, rounds=rounds, warmup_rounds=1)
    rounds_out = [compare_runs(graph, alone, crowded)  # the warm-up round's schedules are dropped
                  for alone, crowded in zip(schedules["in sequence"][1:], schedules["scheduled"][1:])]
    program.reset()
    run_in_sequence(graph, after_each=synchronize_cuda)
    want = program.parameters()
    program.reset()
    schedule, same_clock = run_on_streams(graph, streams, deadline_s=deadline_s)
    got = program.parameters()
    problems = violations(graph, schedule, edges=same_clock) + [p for found in checked_edges for p in found]
    same = all(torch.equal(want[name], got[name]) for name in want)
    replicas = torch.equal(got["W10"], got["W11"]) and torch.equal(got["W20"], got["W21"])
    if trace_dir is not None:
        with profiled(trace_dir, "exp5", cuda=True):
            scheduled()
            in_sequence()
    return {"samples": samples, "rounds": rounds_out, "tasks": len(graph.tasks), "edges": len(graph.edges),
            "check": {"passed": bool(same and replicas and not problems), "bitwise": True,
                      "weights_equal_sequential": bool(same), "replicas_equal": bool(replicas),
                      "problems": problems[:10], "edges_checked": len(same_clock),
                      "what": "final weights == in sequence (bitwise), GPU-GPU and host-host edges respected"}}
