"""Experiment 5 on CPU: the two-layer MLP's task graph run by the dependency-driven scheduler.

Exercise 5: design computation with more complex data dependencies and see whether the results
stay correct while performance improves. The MLP program of autopar_graphs.py runs three ways,
interleaved round by round: strictly in sequence (program order, one thread, one intra-op
thread), by the scheduler (`run_on_lanes`: a thread per device and one for the host, one
intra-op thread each, every task submitted when its last dependency is done), and, for context,
in sequence with every core on each operation (what a plain PyTorch loop does instead).

The ideal is what no scheduler can beat: the longest of the graph's critical path and the
busiest lane's total, from the task durations of the same round's sequential run. When the
scheduler falls short, the run says why from its own numbers: tasks slower side by side than
alone (shared cores and memory), or time between tasks (waiting, handing over). The checks: the
final weights (both replicas) equal the sequential run's bit for bit; the hazard check (versions
seen at run time) finds nothing; every declared edge was respected; and the diamond-and-chain
graph gives the sequential result with every one of its dependencies respected.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from phalanx.autopar.graphs import HOST, DiamondChainProgram, MLPProgram
from phalanx.autopar.trace import profiled
from phalanx.autopar.taskgraph import (Schedule, ThreadLanes, compare_runs, run_in_sequence, run_on_lanes,
                                     violations)
from phalanx.autopar.taskgraph_program import HazardCheck, program_graph
from phalanx.measure.timing import intra_op_threads, run_interleaved

LANES = ("device0", "device1", HOST)


def both_ways(steps, *, reset: Callable[[], None], result: Callable[[], Any], lanes: ThreadLanes,
              sequence: ThreadLanes, deadline_s: float) -> tuple[Any, Any, list[str], int]:
    """Run a program in sequence, then by the scheduler, both under the hazard check: the two
    results, every problem found (versions, and the declared edges in the scheduled run), edges."""
    hazards = HazardCheck(steps)
    graph = hazards.graph()
    reset()
    sequence.run_all({"sequence": lambda: run_in_sequence(graph)}, deadline_s=deadline_s)
    want, problems = result(), list(hazards.problems)
    hazards.reset()
    reset()
    schedule = run_on_lanes(graph, lanes, deadline_s=deadline_s)
    got = result()
    return want, got, problems + violations(graph, schedule) + hazards.problems, len(graph.edges)


def measure_cpu_mlp(*, batch_size: int, in_features: int, hidden: int, out_features: int, steps: int, rounds: int,
                    cores: int, dtype: str, deadline_s: float, trace_dir: str | None = None) -> dict[str, Any]:
    program = MLPProgram(batch_size=batch_size, in_features=in_features, hidden=hidden,
                         out_features=out_features, steps=steps, dtype=getattr(torch, dtype))
    steps_list = program.program()
    graph = program_graph(steps_list)
    schedules: dict[str, list[Schedule]] = {"in sequence": [], "scheduled": []}
    with ThreadLanes(LANES, intra_op_threads=1) as lanes, ThreadLanes(["sequence"], intra_op_threads=1) as sequence:
        def in_sequence() -> float:
            program.reset()
            start_s = time.perf_counter()
            schedule = sequence.run_all({"sequence": lambda: run_in_sequence(graph)}, deadline_s=deadline_s)
            elapsed_s = time.perf_counter() - start_s
            schedules["in sequence"].append(schedule["sequence"])
            return elapsed_s

        def scheduled() -> float:
            program.reset()
            start_s = time.perf_counter()
            schedule = run_on_lanes(graph, lanes, deadline_s=deadline_s)
            elapsed_s = time.perf_counter() - start_s
            schedules["scheduled"].append(schedule)
            return elapsed_s

        def all_cores() -> float:
            program.reset()
            with intra_op_threads(cores):
                start_s = time.perf_counter()
                run_in_sequence(graph)
                return time.perf_counter() - start_s

        samples = run_interleaved({"in sequence": in_sequence, "scheduled": scheduled,
                                   "in sequence, all cores": all_cores}, rounds=rounds, warmup_rounds=1)
        runs = {name: values[1:] for name, values in schedules.items()}  # drop the warm-up round
        check = _checks(program, steps_list, lanes, sequence, deadline_s=deadline_s)
        if trace_dir is not None:
            with profiled(trace_dir, "exp5"):
                scheduled()
                in_sequence()
    rounds_out = [compare_runs(graph, alone, crowded) for alone, crowded in zip(runs["in sequence"], runs["scheduled"])]
    return {"samples": samples, "rounds": rounds_out, "check": check,
            "tasks": len(graph.tasks), "edges": len(graph.edges)}


def _checks(program: MLPProgram, steps, lanes: ThreadLanes, sequence: ThreadLanes, *,
            deadline_s: float) -> dict[str, Any]:
    want, got, problems, edges = both_ways(steps, reset=program.reset, result=program.parameters, lanes=lanes,
                                           sequence=sequence, deadline_s=deadline_s)
    same = all(torch.equal(want[name], got[name]) for name in want)
    replicas = torch.equal(got["W10"], got["W11"]) and torch.equal(got["W20"], got["W21"])
    diamond = check_diamond_chain(lanes, sequence, deadline_s=deadline_s)
    passed = same and replicas and not problems and diamond["passed"]
    return {"passed": bool(passed), "bitwise": True, "weights_equal_sequential": bool(same),
            "replicas_equal": bool(replicas), "problems": problems[:10], "edges_checked": edges,
            "diamond_chain": diamond,
            "what": "final weights == in sequence (bitwise), every dependency respected (edges and versions)"}


def check_diamond_chain(lanes: ThreadLanes, sequence: ThreadLanes, *, deadline_s: float,
                        chain_length: int = 12) -> dict[str, Any]:
    """The diamond + chain graph: scheduled result == sequential, and no dependency broken."""
    program = DiamondChainProgram(chain_length=chain_length, lanes=("device0", "device1"))
    steps = program.program()
    want, got, problems, edges = both_ways(steps, reset=program.reset, result=program.result, lanes=lanes,
                                           sequence=sequence, deadline_s=deadline_s)
    same = torch.equal(want, got)
    return {"passed": bool(same and not problems), "result_equal": bool(same), "problems": problems[:10],
            "tasks": len(steps), "edges": edges}
