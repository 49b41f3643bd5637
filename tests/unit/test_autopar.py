"""`bench autopar` without processes: the task graph and its schedulers, the program-derived
dependencies and the hazard check (a planted missing dependency must be caught), the MLP's hand-
written backward against autograd, each in-process experiment's correctness check at tiny sizes
(and that it can fail), the outcome / crossover / verdict arithmetic from given timings, the
trace picture, and the config's refusals. No timed assertions: timings only feed arithmetic.
"""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest
import torch

from phalanx.autopar import ops as autopar_ops
from phalanx.autopar import exercises
from phalanx.autopar import report as autopar_report
from phalanx.bench.cli import BENCHMARKS, run_bench
from phalanx.cli import build_parser
from phalanx.autopar.exercises import AutoparBenchConfig
from phalanx.autopar.deps import check_diamond_chain, measure_cpu_mlp
from phalanx.autopar.graphs import DiamondChainProgram, MLPProgram
from phalanx.autopar.trace import profiled, records_every_thread, render_timeline, row_name, timeline_rows
from phalanx.autopar.taskgraph import (Schedule, Span, Task, TaskGraph, ThreadLanes, bounds, compare_runs, critical_path,
                                     run_in_sequence, run_on_lanes, violations)
from phalanx.autopar.taskgraph_program import HazardCheck, Step, program_graph
from phalanx.errors import UsageError

LANES = ("device0", "device1", "host")


# torch 2.4-2.6 (which pyproject accepts) has no profile_all_threads; --trace is refused there.
EVERY_THREAD = pytest.mark.skipif(not records_every_thread(), reason="this torch's profiler records one thread")


def _noop() -> None:
    return None


def without_edge(graph: TaskGraph, before: str, after: str) -> TaskGraph:
    """The same graph missing the edge before -> after: the planted bug the checks must catch."""
    if before not in graph.tasks[after].deps:
        raise ValueError(f"{after!r} does not depend on {before!r}")
    return TaskGraph(Task(name=t.name, lane=t.lane, fn=t.fn,
                          deps=tuple(d for d in t.deps if not (t.name == after and d == before)))
                     for t in graph.tasks.values())


# --- the task graph -------------------------------------------------------------------------

def test_graph_refuses_duplicates_unknown_dependencies_and_cycles():
    with pytest.raises(ValueError, match="defined twice"):
        TaskGraph([Task(name="a", lane="x", fn=_noop), Task(name="a", lane="x", fn=_noop)])
    with pytest.raises(ValueError, match=r"unknown task\(s\) \['z'\]"):
        TaskGraph([Task(name="a", lane="x", fn=_noop, deps=("z",))])
    with pytest.raises(ValueError, match="cycle"):
        TaskGraph([Task(name="a", lane="x", fn=_noop, deps=("b",)), Task(name="b", lane="x", fn=_noop, deps=("a",))])


def test_topological_order_is_stable_and_orders_are_checked():
    graph = TaskGraph([Task(name="c", lane="x", fn=_noop, deps=("a",)), Task(name="a", lane="x", fn=_noop),
                       Task(name="b", lane="y", fn=_noop)])
    assert graph.order == ["a", "c", "b"]  # c waits for a, then among the ready ones c was defined first
    graph.check_order(["b", "a", "c"])
    with pytest.raises(ValueError, match="before its dependencies"):
        graph.check_order(["c", "a", "b"])
    with pytest.raises(ValueError, match="each of the 3 tasks once"):
        graph.check_order(["a", "b"])


def test_critical_path_is_the_longest_dependent_chain():
    # a -> b -> d and a -> c -> d: with c slower, the path goes through c.
    graph = TaskGraph([Task(name="a", lane="x", fn=_noop), Task(name="b", lane="x", fn=_noop, deps=("a",)),
                       Task(name="c", lane="y", fn=_noop, deps=("a",)),
                       Task(name="d", lane="x", fn=_noop, deps=("b", "c")), Task(name="e", lane="y", fn=_noop)])
    length, path = critical_path(graph, {"a": 1.0, "b": 2.0, "c": 5.0, "d": 1.0, "e": 6.5})
    assert (length, path) == (7.0, ["a", "c", "d"])
    lanes = bounds(graph, {"a": 1.0, "b": 2.0, "c": 5.0, "d": 1.0, "e": 6.5})
    assert lanes == {"critical_path_s": 7.0, "busiest_lane_s": 11.5, "ideal_s": 11.5}  # y runs c and e: 11.5


def test_compare_runs_splits_the_gap_into_task_slowdown_and_time_between_tasks():
    graph = TaskGraph([Task(name="a", lane="x", fn=_noop), Task(name="b", lane="y", fn=_noop),
                       Task(name="c", lane="x", fn=_noop, deps=("a", "b"))])
    alone = Schedule({"a": Span(lane="x", start_s=0.0, end_s=2.0), "b": Span(lane="y", start_s=2.0, end_s=4.0),
                      "c": Span(lane="x", start_s=4.0, end_s=5.0)})
    crowded = Schedule({"a": Span(lane="x", start_s=0.0, end_s=3.0), "b": Span(lane="y", start_s=0.0, end_s=3.0),
                        "c": Span(lane="x", start_s=3.5, end_s=5.0)})
    got = compare_runs(graph, alone, crowded)
    assert got == {"critical_path_s": 3.0, "busiest_lane_s": 3.0, "ideal_s": 3.0, "ideal_side_by_side_s": 4.5,
                   "task_slowdown": 7.5 / 5.0}


def test_violations_name_each_edge_run_out_of_order():
    graph = TaskGraph([Task(name="a", lane="x", fn=_noop), Task(name="b", lane="y", fn=_noop, deps=("a",))])
    good = Schedule({"a": Span(lane="x", start_s=0.0, end_s=1.0), "b": Span(lane="y", start_s=1.0, end_s=2.0)})
    bad = Schedule({"a": Span(lane="x", start_s=0.0, end_s=1.0), "b": Span(lane="y", start_s=0.5, end_s=2.0)})
    assert violations(graph, good) == []
    assert violations(graph, bad) == ["b started 500.000 ms before a ended"]
    assert violations(graph, Schedule({"a": good.spans["a"]})) == ["b never ran"]


def test_scheduler_runs_each_task_on_its_lane_after_its_dependencies():
    seen: dict[str, str] = {}

    def task(name):
        return lambda: seen.__setitem__(name, threading.current_thread().name)
    graph = TaskGraph([Task(name="a", lane="device0", fn=task("a")),
                       Task(name="b", lane="device1", fn=task("b"), deps=("a",)),
                       Task(name="c", lane="host", fn=task("c"), deps=("a", "b", "a"))])
    with ThreadLanes(LANES) as lanes:
        schedule = run_on_lanes(graph, lanes, deadline_s=30)
    assert violations(graph, schedule) == []
    assert [schedule.spans[n].lane for n in "abc"] == ["device0", "device1", "host"]
    assert all(seen[n].startswith(f"lane-{schedule.spans[n].lane}") for n in "abc")


def test_scheduler_reports_a_failing_task_and_a_missing_lane():
    def boom():
        raise ArithmeticError("task failed on purpose")
    graph = TaskGraph([Task(name="a", lane="device0", fn=boom), Task(name="b", lane="device1", fn=_noop, deps=("a",))])
    with ThreadLanes(LANES) as lanes:
        with pytest.raises(ArithmeticError, match="on purpose"):
            run_on_lanes(graph, lanes, deadline_s=30)
    with ThreadLanes(["device0"]) as lanes, pytest.raises(ValueError, match=r"\['device1'\]"):
        run_on_lanes(graph, lanes, deadline_s=30)


def test_lanes_use_their_own_intra_op_thread_count():
    with ThreadLanes(["a", "b"], intra_op_threads=1) as lanes:
        counts = lanes.run_all({"a": torch.get_num_threads, "b": torch.get_num_threads}, deadline_s=30)
    assert counts == {"a": 1, "b": 1}
    with pytest.raises(ValueError):
        ThreadLanes(["a"], intra_op_threads=0)


def test_cuda_launch_order_queues_every_ready_device_task_before_a_host_task():
    from phalanx.autopar.cuda_graph import launch_order

    graph = TaskGraph([Task(name="g0", lane="device0", fn=_noop), Task(name="h", lane="host", fn=_noop, deps=("g0",)),
                       Task(name="g1", lane="device1", fn=_noop, deps=("g0",)),
                       Task(name="g2", lane="device0", fn=_noop, deps=("g1",)),
                       Task(name="g3", lane="device1", fn=_noop, deps=("h",))])
    order = launch_order(graph, {"host"})
    assert order == ["g0", "g1", "g2", "h", "g3"]  # program order would run h second
    graph.check_order(order)


# --- dependencies derived from a program, and the hazard check --------------------------------

def test_program_graph_derives_read_after_write_write_after_read_and_write_after_write():
    steps = [Step(name="w1", lane="x", writes=("A",), fn=_noop),
             Step(name="r1", lane="y", reads=("A",), writes=("B",), fn=_noop),
             Step(name="r2", lane="x", reads=("A",), fn=_noop),
             Step(name="w2", lane="y", writes=("A",), fn=_noop),  # after both readers, and after w1
             Step(name="rw", lane="x", reads=("A", "B"), writes=("B",), fn=_noop)]
    graph = program_graph(steps)
    assert {n: set(t.deps) for n, t in graph.tasks.items()} == {
        "w1": set(), "r1": {"w1"}, "r2": {"w1"}, "w2": {"w1", "r1", "r2"}, "rw": {"w2", "r1"}}
    assert graph.order == ["w1", "r1", "r2", "w2", "rw"]


def _diamond(chain_length=6):
    program = DiamondChainProgram(size=8, chain_length=chain_length, lanes=("device0", "device1"))
    return program, program.program()


def test_diamond_and_chain_scheduled_equal_sequential_with_every_dependency_respected():
    with ThreadLanes(LANES) as lanes, ThreadLanes(["sequence"]) as sequence:
        result = check_diamond_chain(lanes, sequence, deadline_s=30, chain_length=6)
    assert result == {"passed": True, "result_equal": True, "problems": [], "tasks": 11, "edges": 11}


def test_a_planted_missing_dependency_is_caught_in_sequence():
    program, steps = _diamond()
    hazards = HazardCheck(steps)
    graph = hazards.graph()
    program.reset()
    run_in_sequence(graph)
    want = program.result()
    assert hazards.problems == []
    broken = without_edge(graph, "chain5", "sink")  # the sink no longer waits for the chain's end
    early = ["a", "b", "c", "d", *(f"chain{i}" for i in range(5)), "sink", "chain5"]
    hazards.reset()
    program.reset()
    run_in_sequence(broken, order=early)  # a valid order for the broken graph
    assert hazards.problems == ["sink found chain at version 5, program order says 6"]
    assert not torch.equal(program.result(), want)
    with pytest.raises(ValueError, match="before its dependencies"):
        run_in_sequence(graph, order=early)  # the whole graph refuses that order


def test_a_missing_write_after_read_edge_is_caught():
    steps = [Step(name="w", lane="x", writes=("A",), fn=_noop), Step(name="r", lane="y", reads=("A",), fn=_noop),
             Step(name="w2", lane="x", writes=("A",), fn=_noop)]
    hazards = HazardCheck(steps)
    run_in_sequence(without_edge(hazards.graph(), "r", "w2"), order=["w", "w2", "r"])
    assert hazards.problems == ["w2 overwrote A while 1 reader(s) of it had not finished",
                                "r found A at version 2, program order says 1"]


def test_a_planted_missing_dependency_is_caught_under_the_scheduler():
    """`slow` waits until `fast` has started (or 0.5 s): with the edge slow -> fast present that
    never happens; with it missing, `fast` runs during `slow`, which both checks must catch."""
    started = threading.Event()
    value = torch.zeros(1, dtype=torch.float64)
    steps = [Step(name="slow", lane="device0", writes=("v",), fn=lambda: (started.wait(0.5), value.add_(1.0))),
             Step(name="fast", lane="device1", reads=("v",), writes=("out",), fn=started.set)]
    for broken in (False, True):
        started.clear()
        hazards = HazardCheck(steps)
        graph = hazards.graph()
        run = without_edge(graph, "slow", "fast") if broken else graph
        with ThreadLanes(LANES) as lanes:
            schedule = run_on_lanes(run, lanes, deadline_s=30)
        found = violations(graph, schedule) + hazards.problems  # checked against the true edges
        if broken:
            assert len(found) == 2 and found[0].startswith("fast started") and "version 0" in found[1]
        else:
            assert found == []


def test_without_edge_refuses_an_edge_that_is_not_there():
    _, steps = _diamond()
    with pytest.raises(ValueError, match="does not depend"):
        without_edge(program_graph(steps), "sink", "a")


# --- the MLP program ------------------------------------------------------------------------

def _autograd_reference(program: MLPProgram, x, y, steps: int):
    w1, w2 = program.initial_w1.clone().requires_grad_(), program.initial_w2.clone().requires_grad_()
    for _ in range(steps):
        loss = ((torch.relu(x @ w1) @ w2 - y) ** 2).mean()
        g1, g2 = torch.autograd.grad(loss, (w1, w2))
        with torch.no_grad():
            w1 -= program.lr * g1
            w2 -= program.lr * g2
    return w1.detach(), w2.detach()


def test_mlp_program_is_sgd_on_the_full_batch_and_the_scheduler_matches_it_bitwise():
    program = MLPProgram(batch_size=6, in_features=5, hidden=7, out_features=3, steps=3, dtype=torch.float64)
    x = torch.cat([program.b["X0"], program.b["X1"]])
    y = torch.cat([program.b["Y0"], program.b["Y1"]])
    steps = program.program()
    assert len(steps) == 3 * 22
    hazards = HazardCheck(steps)
    graph = hazards.graph()
    program.reset()
    run_in_sequence(graph)
    sequential = program.parameters()
    w1, w2 = _autograd_reference(program, x, y, 3)
    torch.testing.assert_close(sequential["W10"], w1, rtol=1e-12, atol=1e-14)  # halves summed: order differs
    torch.testing.assert_close(sequential["W20"], w2, rtol=1e-12, atol=1e-14)
    hazards.reset()
    program.reset()
    with ThreadLanes(LANES) as lanes:
        schedule = run_on_lanes(graph, lanes, deadline_s=30)
    got = program.parameters()
    assert violations(graph, schedule) == [] and hazards.problems == []
    assert all(torch.equal(got[name], sequential[name]) for name in sequential)
    assert torch.equal(got["W10"], got["W11"]) and torch.equal(got["W20"], got["W21"])


def test_mlp_refuses_an_odd_batch():
    with pytest.raises(ValueError, match="even"):
        MLPProgram(batch_size=5, in_features=2, hidden=2, out_features=2, steps=1)


@EVERY_THREAD
def test_experiment_5_on_cpu_at_tiny_sizes_passes_its_checks(tmp_path):
    m = measure_cpu_mlp(batch_size=8, in_features=6, hidden=5, out_features=3, steps=2, rounds=2, cores=2,
                        dtype="float64", deadline_s=60, trace_dir=str(tmp_path))
    assert m["check"]["passed"] and m["check"]["problems"] == [] and m["check"]["diamond_chain"]["passed"]
    assert set(m["samples"]) == {"in sequence", "scheduled", "in sequence, all cores"}
    assert all(len(v) == 2 for v in m["samples"].values()) and len(m["rounds"]) == 2
    for r in m["rounds"]:
        assert r["ideal_s"] == max(r["critical_path_s"], r["busiest_lane_s"])
    assert (tmp_path / "exp5.json").exists() and (tmp_path / "exp5.png").read_bytes()[:4] == b"\x89PNG"


# --- experiments 1 and 2 on CPU ---------------------------------------------------------------

@EVERY_THREAD
def test_independent_products_check_passes_and_reports_every_contender(tmp_path):
    m = autopar_ops.measure_cpu(size=8, count=5, cores=2, lanes=2, rounds=2, target_s=1e-4, dtype="float64",
                                each_alone=True, deadline_s=60, trace=(str(tmp_path), "exp1"))
    assert m["check"]["passed"]
    assert set(m["samples"]) == {"eager", "concurrent", "each alone, summed", "share 0 alone", "share 1 alone"}
    rows = timeline_rows(tmp_path / "exp1.json")
    names = {row_name(key, events) for key, events in rows.items()}
    assert {"lane0", "lane1", "main"} <= names


def test_independent_products_check_fails_when_a_lane_computes_something_else(monkeypatch):
    run = autopar_ops.Products.run

    def sabotaged(self, indices, repeats=None):
        run(self, indices, repeats)
        if threading.current_thread().name.startswith("lane-lane1"):
            for i in indices:
                self.outputs[i].add_(1.0)  # lane1's share comes out different from one after another
    monkeypatch.setattr(autopar_ops.Products, "run", sabotaged)
    products = autopar_ops.Products(size=4, count=4, lanes=2, dtype="float64")
    with ThreadLanes(["lane0", "lane1"]) as lanes:
        assert not autopar_ops.check_bitwise(products, lanes, deadline_s=30)["passed"]


# --- outcome, crossover and verdicts from given timings ----------------------------------------

def test_outcome_takes_per_round_ratios():
    out = autopar_report.outcome(measured_s=[2.0, 1.0, 4.0], sequential_s=[4.0, 3.0, 4.0], ideal_s=[1.0, 1.0, 2.0])
    assert out["speedup"]["samples"] == [2.0, 3.0, 1.0] and out["speedup"]["median"] == 2.0
    assert out["ideal_speedup"]["samples"] == [4.0, 3.0, 2.0]
    assert out["share_of_ideal"]["samples"] == [0.5, 1.0, 0.5]
    assert out["measured_s"]["median"] == 2.0


@pytest.mark.parametrize("speedups, want", [
    ([2.4, 1.5, 1.2, 1.05, 0.98], {"size": 256, "kind": "crossover", "exceptions": []}),
    ([1.5, 1.3, 1.2, 1.2, 1.1], {"size": None, "kind": "wins everywhere", "exceptions": []}),
    ([1.0, 0.9, 1.05, 1.0, 0.9], {"size": 32, "kind": "never wins", "exceptions": []}),
    ([1.5, 1.0, 1.3, 1.0, 1.0], {"size": 256, "kind": "crossover", "exceptions": [64]}),
    ([1.3, 1.2, 1.0, 1.3, 1.3], {"size": None, "kind": "wins everywhere", "exceptions": [128]}),
    ([1.0, 1.2, 1.0, 1.0, 1.3], {"size": None, "kind": "isolated", "exceptions": []}),  # 2 wins in 5: no range
])
def test_crossover_is_where_concurrency_stops_winning(speedups, want):
    got = autopar_report.crossover([32, 64, 128, 256, 512], speedups)
    assert {k: got[k] for k in ("size", "kind", "exceptions")} == want


def test_the_sweep_verdict_follows_the_numbers_of_the_h200():
    """Exercise 2 on an H200 (2026-11-27): 1.14x at n=32 and 1.26x at n=1024, 0.95-1.03x elsewhere:
    two isolated wins, not "concurrency wins below n=2048 (at least 1.10x faster, except at n=64, 128, 256, 512)"."""
    sizes, speedups = [32, 64, 128, 256, 512, 1024, 2048], [1.14, 0.97, 0.95, 0.98, 0.98, 1.26, 1.03]
    cross = autopar_report.crossover(sizes, speedups)
    assert cross["kind"] == "isolated" and cross["wins"] == [32, 1024] and cross["size"] is None
    assert autopar_report.verdict_sweep(cross, sizes, speedups, "concurrency") == (
        "concurrency wins by at least 1.10x only at n=32 (1.14x), n=1024 (1.26x); at the other 5 sizes it gives "
        "0.95-1.03x: isolated sizes, no range below a crossover.")


def test_exercise_1_on_a_gpu_takes_the_device_as_its_ideal():
    """An H200 (2026-11-27): 8 products of 4096^2 on 4 streams, 42.5 ms against 42.9 ms in sequence,
    each stream's share alone 11.1 ms - an "ideal" of 3.86x no GPU can give, since one product fills it."""
    samples = {"eager": [0.0429, 0.0430], "concurrent": [0.0425, 0.0425], "batched": [0.0412, 0.0413],
               **{f"share {i} alone": [0.0111, 0.0111] for i in range(4)}}
    ideal = exercises._ideal(samples)
    assert ideal == [0.0412, 0.0413] and exercises._device_bound_s(samples) == pytest.approx(0.04125)
    result = autopar_report.outcome(measured_s=samples["concurrent"], sequential_s=samples["eager"], ideal_s=ideal)
    text = autopar_report.verdict_independent(result, eager_over_alone=0.97, how="explicitly concurrent",
                                              asynchronous=True, device_bound_s=exercises._device_bound_s(samples))
    assert "little to gain here (ideal 1.04x): all of them as one batched kernel take 41.2 ms" in text
    assert "3.86" not in text
    small = {"eager": [0.004], "concurrent": [0.0015], "batched": [0.0005], "share 0 alone": [0.001],
             "share 1 alone": [0.0012]}  # small products: the lanes, not the device, bound it
    assert exercises._ideal(small) == [0.0012] and exercises._device_bound_s(small) is None
    cpu = {"eager": [0.004], "concurrent": [0.002], "share 0 alone": [0.001], "share 1 alone": [0.0012]}
    assert exercises._ideal(cpu) == [0.0012] and exercises._device_bound_s(cpu) is None


def test_crossover_refuses_mismatched_or_unsorted_sizes():
    with pytest.raises(ValueError, match="one speed-up per size"):
        autopar_report.crossover([32, 64], [1.0])
    with pytest.raises(ValueError, match="ascend"):
        autopar_report.crossover([64, 32], [1.0, 1.0])


def _result(measured, sequential, ideal):
    return autopar_report.outcome(measured_s=[measured], sequential_s=[sequential], ideal_s=[ideal])


def test_verdicts_say_what_the_numbers_say():
    r = _result(0.050, 0.100, 0.050)
    one = autopar_report.verdict_independent(r, eager_over_alone=1.01, how="explicitly concurrent", asynchronous=False)
    assert "not by itself" in one and "1.01x" in one and "2.00x - concurrency pays, 100% of the ideal 2.00x" in one
    assert "noise" not in one
    cpu = autopar_report.verdict_independent(r, eager_over_alone=0.8, how="x", asynchronous=False)
    assert "not by itself" in cpu and "0.80x" in cpu and "noise" in cpu  # a CPU op cannot overlap the next
    gpu = autopar_report.verdict_independent(r, eager_over_alone=0.5, how="x", asynchronous=True)
    assert "asynchronous launches hide the gaps" in gpu and "one after another" in gpu
    assert "not by itself" in autopar_report.verdict_independent(r, eager_over_alone=0.95, how="x", asynchronous=True)
    flat = autopar_report.verdict_independent(_result(0.1, 0.1, 0.098), eager_over_alone=None, how="x",
                                              asynchronous=False)
    assert "little to gain" in flat and "98%" in flat
    cross = autopar_report.crossover([32, 64, 128], [2.0, 1.2, 1.0])
    assert "wins below n=128 (at least 1.10x faster) and no longer from n=128 on" in autopar_report.verdict_sweep(
        cross, [32, 64, 128], [2.0, 1.2, 1.0], "concurrency")
    dip = autopar_report.crossover([32, 64, 128], [2.0, 1.0, 1.2])
    assert "except at n=64" in autopar_report.verdict_sweep(dip, [32, 64, 128], [2.0, 1.0, 1.2], "concurrency")
    pipe = autopar_report.verdict_pipeline(_result(0.040, 0.060, 0.020), stages_s={"compute": 0.002, "transfer": 0.001,
                                           "reduce": 0.001}, chunks=8, cores=2)
    assert "slowest stage is compute (2.00 ms" in pipe and "share 2 cores" in pipe  # 50% < 80% of the ideal
    rounds = [{"task_slowdown": 1.25, "ideal_side_by_side_s": 0.060}]
    short = autopar_report.verdict_graph(_result(0.080, 0.100, 0.050), rounds=rounds, tasks=44, all_cores_s=0.07,
                                         edges=118, check_passed=True)
    assert "what stops it: tasks ran 1.25x slower" in short and "20.0 ms went between tasks" in short
    assert "bitwise equal" in short and "118 dependencies" in short
    good = autopar_report.verdict_graph(_result(0.055, 0.100, 0.050), rounds=rounds, tasks=44, all_cores_s=0.07,
                                        edges=118, check_passed=False)
    assert "reaches at least 80%" in good and "DIFFER" in good


def test_cpu_taken_by_others_is_machine_busy_minus_our_own_per_wall_second(monkeypatch):
    from phalanx.measure import load

    # machine busy +3 s (+0.5 s of it stolen by the hypervisor for other guests), this process +1 s ...
    readings = iter([(100.0, 40.0, 5.0), (103.0, 40.5, 6.0)])
    clock = iter([10.0, 12.0])  # ... over 2 s of wall time: others kept 1 core busy, 0.25 of it stolen
    monkeypatch.setattr(load, "_machine_and_own_cpu_s", lambda: next(readings))
    monkeypatch.setattr(load.time, "perf_counter", lambda: next(clock))
    result: dict = {}
    with load.cpu_taken_by_others(result):
        pass
    assert result == {"others_cores": 1.0, "stolen_cores": 0.25}


def test_cpu_taken_by_others_reads_this_machine():
    from phalanx.measure import load

    result: dict = {}
    with load.cpu_taken_by_others(result):
        sum(range(10_000))
    assert result["others_cores"] is None or result["others_cores"] >= 0.0


# --- trace picture and config ---------------------------------------------------------------------

def test_timeline_rows_and_picture_from_a_trace(tmp_path):
    events = [{"ph": "X", "cat": "user_annotation", "name": "fwd1 d0 s0 @device0", "pid": 1, "tid": 7, "ts": 1000.0,
               "dur": 500.0},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 7, "ts": 1100.0, "dur": 100.0},
              {"ph": "X", "cat": "user_annotation", "name": "gloo:send", "pid": 1, "tid": 9, "ts": 900.0, "dur": 10.0},
              {"ph": "X", "cat": "user_annotation", "name": "sum1 s0 @host", "pid": 1, "tid": 8, "ts": 1600.0,
               "dur": 50.0}, {"ph": "i", "name": "ignored", "ts": 0}]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    rows = timeline_rows(path)
    assert list(rows) == ["1/7", "1/8", "1/9"]  # rows with our labels first
    assert rows["1/7"][0] == {"name": "fwd1 d0 s0 @device0", "label": True, "start_ms": 0.1, "end_ms": 0.6,
                              "gpu": False}
    assert row_name("0/7", [{"name": "gemm", "label": False, "gpu": True}]) == "GPU 0 stream 7"
    assert rows["1/9"][0]["label"] is False  # a backend's own annotation is drawn like an operator
    assert [row_name(k, v) for k, v in rows.items()] == ["device0", "host", "thread 9"]
    render_timeline(path)  # draws without error


def test_profiled_writes_nothing_without_a_directory(tmp_path):
    with profiled(None, "x"):
        torch.mm(torch.ones(2, 2), torch.ones(2, 2))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kwargs, words", [
    ({"experiments": (1, 4)}, "--trace DIR"),
    ({"experiments": (6,)}, "--experiments 6: choose distinct ones of 1, 2, 3, 5"),
    ({"experiments": (1, 1)}, "distinct"),
    ({"sizes": (64, 32)}, "--sizes 64,32 must be distinct positive numbers in ascending order"),
    ({"lanes": 1}, "--lanes 1 must be at least 2"),
    ({"batch_size": 7}, "--batch-size 7 must be even"),
    ({"rounds": 0}, "--rounds 0 must be at least 1"),
    ({"chunk_rows": 0}, "--chunk-rows 0 must be at least 1"),
    ({"device": "tpu"}, "--device 'tpu'"),
    ({"dtype": "int8"}, "--dtype 'int8' is unknown"),
    ({"target_ms": 0.0}, "--target-ms 0.0"),
])
def test_config_refuses_bad_numbers_by_name(kwargs, words):
    with pytest.raises(ValueError) as error:
        AutoparBenchConfig(**kwargs)
    assert words in str(error.value)


def test_trace_on_a_torch_whose_profiler_records_one_thread_is_refused_before_anything_runs(monkeypatch, tmp_path):
    """Found on torch 2.4.1, which pyproject accepts: the profiler's constructor refused the keyword
    after experiments had run."""
    class OlderConfig:
        def __init__(self, **kwargs):
            if kwargs:
                raise TypeError("__init__(): incompatible constructor arguments")

    monkeypatch.setattr(torch._C._profiler, "_ExperimentalConfig", OlderConfig)
    with pytest.raises(ValueError, match=r"^--trace needs a torch whose profiler records every thread "
                                         r"\(profile_all_threads, torch 2.7 or later\), and this is torch "):
        AutoparBenchConfig(trace_dir=str(tmp_path / "t"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cuda_without_a_gpu_is_refused():
    with pytest.raises(ValueError, match="use --device cpu"):
        AutoparBenchConfig(device="cuda").resolved()


def test_resolved_fills_the_cpu_defaults():
    config = AutoparBenchConfig(device="cpu").resolved()
    assert config.lanes >= 2 and config.ops_per_size == 2 * config.lanes
    assert (config.matrix_size, config.chunk_rows, config.width, config.batch_size) == (512, 8192, 64, 1024)


def _run(argv, out_dir):
    return run_bench(build_parser(["bench"]).parse_args(argv + ["--out", str(out_dir)]))


def test_autopar_bench_refuses_bad_flags_before_measuring(tmp_path):
    with pytest.raises(UsageError, match="--trace DIR"):
        _run(["bench", "autopar", "--device", "cpu", "--experiments", "1,4"], tmp_path / "a")
    with pytest.raises(UsageError, match="--experiments"):
        _run(["bench", "autopar", "--device", "cpu", "--experiments", "one"], tmp_path / "b")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="--trace"):
        _run(["bench", "autopar", "--device", "cpu", "--trace", str(tmp_path / "file")], tmp_path / "c")
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()  # nothing half-written


def test_a_failed_check_exits_1_after_writing_the_table_json_and_png(tmp_path, monkeypatch, capsys):
    result = autopar_report.outcome(measured_s=[1.0], sequential_s=[2.0], ideal_s=[1.0])
    failed = {"passed": False, "bitwise": True, "what": "planted"}

    def fake_run(config):
        return {"bench": "autopar", "config": {"rounds": 1}, "where": "here", "trace_dir": None, "elapsed_s": 0.1,
                "experiments": [{"experiment": 5, "title": "t", "how": "h", "outcome": result, "check": failed,
                                 "verdict": "v", "others_cores": 0.0}], "checks_passed": False}
    monkeypatch.setitem(BENCHMARKS, "autopar", dataclasses.replace(BENCHMARKS["autopar"], run=fake_run))
    assert _run(["bench", "autopar", "--device", "cpu", "--experiments", "5"], tmp_path) == 1
    assert json.loads((tmp_path / "autopar.json").read_text())["checks_passed"] is False
    assert (tmp_path / "autopar.png").read_bytes()[:4] == b"\x89PNG"
    assert "check: planted: FAILED" in capsys.readouterr().out


def test_a_verdict_measured_under_load_says_so():
    from phalanx.autopar.report import verdict_line
    assert verdict_line({"verdict": "concurrency wins below n=64"}) == "  verdict: concurrency wins below n=64"
    assert verdict_line({"verdict": "x", "others_cores": 0.1}) == "  verdict: x"
    assert verdict_line({"verdict": "x", "others_cores": 1.1}) == (
        "  verdict: x (measured while other processes kept 1.1 cores busy: a quiet machine may differ)")
