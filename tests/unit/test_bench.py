"""The benchmark machinery without processes: the statistics, the interleaving order, the busbw
formula, flag parsing and config validation, the contender set-ups, and the output files."""

from __future__ import annotations

import json
import re

import pytest
import torch

from phalanx.bench.cli import run_bench
from phalanx.cli import build_parser
from phalanx.bench.allreduce import AllreduceBenchConfig, report_allreduce, timed
from phalanx.measure.mlp import WideMLP, build_bench_model
from phalanx.autopar.chapter import OverlapBenchConfig
from phalanx.bench.scaling import ScalingBenchConfig, variants
from phalanx.bench.scaling_side import side_by_side_sets
from phalanx.measure.flags import format_size, parse_size
from phalanx.measure.outputs import format_table, median_whiskers, new_figure, prepare_out_dir, write_outputs
from phalanx.measure.side_by_side import take_turns, with_threads
from phalanx.measure.job_steps import StepJob
from phalanx.measure.step import Variant
from phalanx.measure.timing import (Spread, calls_for, interleave, paired_ratio, run_interleaved, seconds_per_call,
                                    slowest_per_round)
from phalanx.errors import UsageError
from phalanx.options import build, parse_list


def test_spread_is_median_and_min_max():
    odd = Spread.of([3.0, 1.0, 2.0, 10.0, 0.5])
    assert (odd.median, odd.min, odd.max) == (2.0, 0.5, 10.0)
    even = Spread.of([4.0, 1.0, 3.0, 2.0])
    assert even.median == 2.5
    assert even.samples == (4.0, 1.0, 3.0, 2.0)  # kept in round order
    assert Spread.from_dict(even.to_dict()) == even
    assert even.scaled(1e3).median == 2500.0
    with pytest.raises(ValueError):
        Spread.of([])


def test_interleave_is_round_by_round():
    assert interleave(["A", "B"], 3) == [(0, "A"), (0, "B"), (1, "A"), (1, "B"), (2, "A"), (2, "B")]
    with pytest.raises(ValueError):
        interleave(["A"], 0)


def test_run_interleaved_warms_up_then_alternates_and_discards_the_warm_up():
    calls: list[str] = []
    counter = {"A": 0, "B": 0}

    def make(name):
        def run():
            calls.append(name)
            counter[name] += 1
            return float(counter[name])
        return run

    samples = run_interleaved({"A": make("A"), "B": make("B")}, rounds=3, warmup_rounds=1)
    assert calls == ["A", "B", "A", "B", "A", "B", "A", "B"]
    assert samples == {"A": [2.0, 3.0, 4.0], "B": [2.0, 3.0, 4.0]}  # call 1 of each was the warm-up


def test_paired_ratio_takes_per_round_ratios_not_a_ratio_of_medians():
    a, b = [2.0, 4.0, 100.0], [1.0, 4.0, 10.0]  # medians 4 and 4; per-round ratios 2, 1, 10
    ratio = paired_ratio(a, b)
    assert ratio.samples == (2.0, 1.0, 10.0)
    assert ratio.median == 2.0
    with pytest.raises(ValueError):
        paired_ratio([1.0], [1.0, 2.0])


def test_seconds_per_call_counts_calls_and_syncs_once():
    calls, syncs = [], []
    seconds = seconds_per_call(lambda: calls.append(1), 7, sync=lambda: syncs.append(1))
    assert len(calls) == 7 and len(syncs) == 1 and seconds >= 0


def test_calibration_fills_a_timed_batch_within_its_bounds():
    assert calls_for(0.001, target_batch_s=0.02, max_calls=50) == 20  # 20 calls of 1 ms make 20 ms
    assert calls_for(0.0003, target_batch_s=0.02, max_calls=50) == 50  # capped
    assert calls_for(0.5, target_batch_s=0.02, max_calls=50) == 1  # a slow call is timed once
    assert calls_for(0.0, target_batch_s=0.02, max_calls=7) == 7  # a call too fast for the clock
    assert calls_for(0.004) == 5  # the kit's defaults: about 20 ms, at most 50 calls


def test_slowest_rank_decides_each_round():
    # A lockstep step or a collective is done when its last rank is: the max per round, not per rank.
    assert slowest_per_round([[1.0, 5.0, 2.0], [3.0, 1.0, 2.5]]) == [3.0, 5.0, 2.5]
    assert slowest_per_round([[0.25]]) == [0.25]
    with pytest.raises(ValueError, match="same number of rounds"):
        slowest_per_round([[1.0, 2.0], [1.0]])


def test_a_busy_window_notes_wall_own_cpu_and_the_hosts_busy_time(monkeypatch):
    from phalanx.measure import load

    hosts = iter([100.0, 103.5])  # the host was busy 3.5 s ...
    monkeypatch.setattr(load, "host_busy_s", lambda: next(hosts))
    with load.busy_window() as window:
        sum(range(100_000))
    assert window["host_busy_s"] == 3.5 and window["wall_s"] > 0 and window["cpu_s"] >= 0
    # ... of which the workers' own CPU was 1.5 s over a 2 s window: others kept one core busy.
    assert load.others_busy_cores([{"wall_s": 2.0, "cpu_s": 1.0, "host_busy_s": 3.5},
                                   {"wall_s": 2.0, "cpu_s": 0.5, "host_busy_s": None}]) == pytest.approx(1.0)


def test_tables_align_and_whiskers_reach_min_and_max():
    assert format_table(["name", "n"], [("a", 10), ("bbb", 2)]).splitlines() == [
        "name   n", "----  --", "a     10", "bbb    2"]
    assert format_table(["name", "n"], [("a", 10)], left_columns=0).splitlines()[2] == "   a  10"
    rows = [{"x": {"median": 2.0, "min": 1.5, "max": 3.0}}, {"x": {"median": 1.0, "min": 1.0, "max": 1.25}}]
    assert median_whiskers(rows, "x") == ([2.0, 1.0], [[0.5, 0.0], [1.0, 0.25]])


def test_bench_allreduce_times_the_halves_only_where_an_algorithm_has_them():
    config = AllreduceBenchConfig(sizes_bytes=(4096,), algorithms=("native", "tree", "shm"))
    assert timed(config) == [(4096, "allreduce", "native"), (4096, "allreduce", "tree"), (4096, "allreduce", "shm"),
                             (4096, "reduce-scatter", "native"), (4096, "reduce-scatter", "shm"),
                             (4096, "all-gather", "native"), (4096, "all-gather", "shm")]



@pytest.mark.parametrize("rounds, said", [
    ("compiled", "shm's rounds ran compiled (shm_kernel.c)"),
    ("compiled, those of 512KB or more on torch's ops over each rank's 8 intra-op threads",
     "shm's rounds ran compiled (shm_kernel.c), those of 512KB or more on torch's ops over each rank's 8 intra-op threads"),
    ("Python (no C compiler (cc) on PATH)", "shm's rounds ran in Python (no C compiler (cc) on PATH)"),
])
def test_bench_allreduce_says_how_shm_ran_its_rounds(rounds, said):
    payload = {"memcpy": [], "results": [], "ratios": [], "halves": [], "shm_rounds": {2: rounds},
               "config": {"collectives": ["allreduce"], "world_sizes": [2], "rounds": 3}}
    assert said in report_allreduce(payload).splitlines()

def test_sizes_and_lists_parse_in_binary_units():
    assert [parse_size(s) for s in ("4KB", "64kb", "1MB", "16MiB", "65536", "1.5MB")] == [
        4096, 65536, 1 << 20, 16 << 20, 65536, 3 << 19]
    assert [format_size(s) for s in (4096, 1 << 20, 64 << 20, 100)] == ["4KB", "1MB", "64MB", "100B"]
    assert parse_list("2, 3,4", int, flag="--world-sizes") == (2, 3, 4)
    for bad in ("4XB", "KB", "-1MB"):
        with pytest.raises(UsageError):
            parse_size(bad)
    with pytest.raises(UsageError, match="--world-sizes"):
        parse_list("2,x", int, flag="--world-sizes")
    with pytest.raises(UsageError):
        parse_list(" , ", int, flag="--sizes")


@pytest.mark.parametrize("make, words", [
    (lambda: AllreduceBenchConfig(world_sizes=(1, 2)), "--world-sizes 1,2: 1 must be at least 2"),
    (lambda: AllreduceBenchConfig(sizes_bytes=(4096, 6)), "6 bytes is not a positive multiple of 4"),
    (lambda: AllreduceBenchConfig(algorithms=("ring", "magic")), "magic"),
    (lambda: AllreduceBenchConfig(rounds=0), "rounds"),
    (lambda: AllreduceBenchConfig(collectives=("all-reduce",)), "--collectives 'all-reduce' is unknown"),
    (lambda: AllreduceBenchConfig(algorithms=("tree",), collectives=("all-gather",)),
     "all-gather run on native, shm, hierarchical, ring only, not on tree"),
    (lambda: ScalingBenchConfig(global_batch_sizes=(256, 1), device_counts=(2,)), "--batch-sizes 256,1"),
    (lambda: ScalingBenchConfig(device_counts=(1,)), "--devices 1: the largest count must be at least 2"),
    (lambda: ScalingBenchConfig(device_counts=(0, 2)), "--devices 0,2: 0 must be at least 1"),
    (lambda: ScalingBenchConfig(model="resnet"), "resnet"),
    (lambda: ScalingBenchConfig(steps=0), "steps"),
    (lambda: ScalingBenchConfig(grad_dtype="int4"), "--grad-dtype 'int4'"),
    (lambda: OverlapBenchConfig(device="tpu"), "tpu"),
    (lambda: OverlapBenchConfig(matmuls=0), "matmuls"),
])
def test_configs_reject_bad_numbers_by_name(make, words):
    with pytest.raises(ValueError) as error:
        make()
    assert words in str(error.value)


def test_contenders_are_set_up_as_each_user_would_get_them():
    by_name = {v.name: v for v in variants((1, 2, 3), cores=4)}
    assert list(by_name) == ["phalanx/1", "phalanx/2", "phalanx/3", "phalanx/3 gloo", "phalanx/3 overlapped",
                             "phalanx/3 bound", "ddp/3", "ddp/3 tuned", "ceiling/3",
                             "ceiling/3 lockstep", "torch 1 thread", "torch 4 threads", "torch 4 threads tuned"]
    assert [(by_name[f"phalanx/{j}"].num_procs, by_name[f"phalanx/{j}"].threads_per_proc) for j in (1, 2, 3)] == [
        (1, 4), (2, 2), (3, 1)]
    assert all(by_name[f"phalanx/{j}"].allocator_env for j in (1, 2, 3))
    ddp = by_name["ddp/3"]
    assert (ddp.num_procs, ddp.threads_per_proc, ddp.allocator_env) == (3, 1, False)
    ceiling = by_name["ceiling/3"]  # phalanx's worker set-up, minus the communication
    assert (ceiling.num_procs, ceiling.threads_per_proc, ceiling.allocator_env) == (3, 1, True)
    lockstep = by_name["ceiling/3 lockstep"]  # the same ceiling, its ranks meeting at every step
    assert (lockstep.kind, lockstep.num_procs, lockstep.threads_per_proc) == ("lockstep", 3, 1)
    assert not by_name["torch 1 thread"].allocator_env and by_name["torch 4 threads"].threads_per_proc == 4
    assert [v.name for v in variants((2,), cores=1)][-2:] == ["torch 1 thread", "torch 1 thread tuned"]  # no duplicate
    # "tuned" = phalanx's CPU set-up (allocator env, auto memory format), nothing else changed.
    for name in ("ddp/3 tuned", "torch 4 threads tuned", "phalanx/2", "ceiling/3", "ceiling/3 lockstep"):
        assert (by_name[name].allocator_env, by_name[name].memory_format) == (True, "auto"), name
    for name in ("ddp/3", "torch 1 thread", "torch 4 threads"):
        assert (by_name[name].allocator_env, by_name[name].memory_format) == (False, "contiguous"), name
    assert by_name["ddp/3 tuned"].threads_per_proc == by_name["phalanx/3"].threads_per_proc
    assert all(v.grad_dtype is None for v in by_name.values())
    # phalanx's default exchange (auto: shm on one host) against the same run over gloo.
    assert [by_name[n].algorithm for n in ("phalanx/1", "phalanx/3", "phalanx/3 gloo")] == ["auto", "auto", "native"]
    assert (by_name["phalanx/3 gloo"].num_procs, by_name["phalanx/3 gloo"].threads_per_proc) == (3, 1)
    # The exchange beside backward on a thread, which auto turns off where the workers fill the cores.
    assert by_name["phalanx/3 overlapped"].overlap is True
    assert [n for n, v in by_name.items() if v.overlap is not None] == ["phalanx/3 overlapped"]
    # --bind-cores priced beside the default: the same run, each worker on its own cores.
    bound = by_name["phalanx/3 bound"]
    assert (bound.bind_cores, bound.algorithm, bound.num_procs) == (True, "auto", 3)
    assert not any(v.bind_cores for n, v in by_name.items() if n != "phalanx/3 bound")
    assert "phalanx/4 bound" not in {v.name for v in variants((4,), cores=2)}  # no core of its own for each


def test_devices_picks_the_counts_phalanx_runs_on_and_one_always_runs():
    names = [v.name for v in variants((8, 2), cores=16)]
    assert [n for n in names if n.startswith("phalanx/")] == ["phalanx/1", "phalanx/2", "phalanx/8", "phalanx/8 gloo",
                                                             "phalanx/8 overlapped", "phalanx/8 bound"]
    assert {"ddp/8", "ceiling/8", "torch 16 threads"} <= set(names) and "ddp/2" not in names
    assert len(variants((8,), cores=16)) == 2 + 10  # a round at k in {1, 8}: 12 starts, each every batch size


@pytest.mark.parametrize("k, cores", [(2, 1), (2, 2), (4, 16), (8, 16)])
def test_side_by_side_runs_the_contenders_of_phalanxs_set_up_under_their_own_names(k, cores):
    by_name = {v.name: v for v in variants((k,), cores=cores, core_left=True)}
    sets = side_by_side_sets((k,), cores)
    assert [lead for lead, _ in sets] == [f"phalanx/{k}", "phalanx/1"]
    for lead, kinds in sets:
        assert list(kinds.values())[0] == "phalanx" and next(iter(kinds)) == lead
        for name, kind in kinds.items():  # every one shares the start's processes, threads and set-up
            v, first = by_name[name], by_name[lead]
            fewer = kind == "core-left"  # but one thread: what its row says it ran with
            assert (v.num_procs, v.threads_per_proc + fewer, v.allocator_env, v.memory_format) == (
                first.num_procs, first.threads_per_proc, True, "auto"), name
    left = {"core-left"} if cores // k > 1 else set()  # 4 x 4 and 8 x 2 on 16 cores: a thread each to leave
    assert set(sets[0][1].values()) == {"phalanx", "overlapped", "ceiling", "lockstep", "ddp"} | left
    assert set(sets[1][1].values()) == {"phalanx", "torch"}
    assert (f"phalanx/{k} core left" in by_name) == bool(left)
    assert f"phalanx/{k} core left" not in {v.name for v in variants((k,), cores=cores)}  # fresh starts: not run


def test_side_by_side_times_every_other_count_alone_and_its_speedup_over_one_block_by_block(monkeypatch):
    # --devices 1,2,4,8 on 16 cores: phalanx/2 (2 x 8) and phalanx/4 (4 x 4) each in a start of their
    # own, taking turns with phalanx/8's and phalanx/1's; the speed-up is the median of per-block ratios.
    from phalanx.bench import scaling, scaling_side
    from phalanx.bench.scaling_report import report_scaling
    from phalanx.measure.side_by_side import SideBySide

    sets = side_by_side_sets((1, 2, 4, 8), cores=16)
    assert [lead for lead, _ in sets] == ["phalanx/8", "phalanx/2", "phalanx/4", "phalanx/1"]
    assert sets[1][1] == {"phalanx/2": "phalanx"} and sets[2][1] == {"phalanx/4": "phalanx"}
    starts = []

    def fake_side_by_side(jobs, kinds, *, num_procs, threads_per_proc, blocks, timeout_s, deadline_s):
        starts.append((num_procs, threads_per_proc, tuple(kinds)))
        per_block = {8: 4.0, 4: 2.0, 2: 1.0, 1: 1.0}[num_procs]  # seconds per block; phalanx/4 twice phalanx/1
        waits = {"phalanx": 2.0, "lockstep": 0.5}  # ms per step; the others never wait
        return [SideBySide({kind: [per_block * (b + 1) for b in range(blocks)] for kind in kinds},
                           {kind: {"forward": 1.0, "backward": 3.0, "wait": waits.get(kind, 0.0), "optimizer": 0.25,
                                   "other": 0.5} for kind in kinds}) for _ in jobs]

    monkeypatch.setattr(scaling, "available_cores", lambda: 16)
    monkeypatch.setattr(scaling_side, "run_side_by_side", fake_side_by_side)
    config = ScalingBenchConfig(device_counts=(1, 2, 4, 8), side_by_side=True, global_batch_sizes=(256,), blocks=3,
                                rounds=1)
    payload = scaling.run_scaling_bench(config)
    assert [s[:2] for s in starts] == [(8, 2), (2, 8), (4, 4), (1, 16)] and starts[1][2] == ("phalanx",)
    speedup = {r["num_devices"]: r["ratio"]["samples"] for r in payload["ratios"] if r["metric"] == "speedup"}
    assert speedup == {2: pytest.approx([1.0] * 3), 4: pytest.approx([0.5] * 3), 8: pytest.approx([0.25] * 3)}
    assert "phalanx/4" in {v["name"] for v in payload["variants"]}
    # Where each step went: a row per contender and start; the report says what phalanx/8 spent beyond its twin.
    rows = {row["variant"]: row["ms_per_step"] for row in payload["phases"]}
    assert rows["phalanx/8"]["wait"] == 2.0 and rows["ceiling/8 lockstep"]["wait"] == 0.5 and len(rows) == 10
    text = report_scaling(json.loads(json.dumps(payload)))
    assert ("phalanx/8 beyond its lockstep twin: +1.50 ms a step (forward +0.00, backward +0.00, wait +1.50, "
            "optimizer +0.00, other +0.00)") in text
    assert re.search(r"ceiling/8 lockstep\s+1\.00\s+3\.00\s+0\.50\s+0\.25\s+0\.50\s+5\.25", text)


def test_a_core_left_contender_is_built_and_stepped_one_thread_below_the_start():
    before, seen = torch.get_num_threads(), []

    def build():
        seen.append(("built", torch.get_num_threads()))  # what a replica's auto overlap reads
        return lambda: seen.append(("step", torch.get_num_threads()))

    torch.set_num_threads(3)  # the start's count
    try:
        step = with_threads(2, build)
        assert torch.get_num_threads() == 3
        step()
        assert seen == [("built", 2), ("step", 2)] and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_the_team_rounds_contender_puts_every_round_on_the_team_for_its_step_alone():
    from phalanx.comm import shm_kernel
    from phalanx.measure.side_by_side import on_team

    seen, before = [], torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        step = on_team(lambda: seen.append(shm_kernel.team_is_faster(1024)))
        assert not shm_kernel.team_is_faster(1024)  # 4 KB: the compiled kernel's, as phalanx runs it
        step()
        assert seen == [True] and not shm_kernel.team_is_faster(1024)
    finally:
        torch.set_num_threads(before)


def test_side_by_side_contenders_take_turns_in_blocks_rotated_after_each_warms_up():
    log = []
    steppers = {name: (lambda name=name: log.append(name)) for name in ("a", "b", "c")}
    job = StepJob(model="lenet", global_batch_size=8, warmup_steps=2, steps=3, lr=0.1, seed=0)
    seconds = take_turns(steppers, job, 4, barrier=lambda: log.append("|")).seconds
    warm, timed = log[:6], "".join(log[6:])
    assert warm == ["a", "a", "b", "b", "c", "c"]
    assert timed.split("|")[1:] == ["aaa", "bbb", "ccc", "bbb", "ccc", "aaa", "ccc", "aaa", "bbb", "aaa", "bbb", "ccc"]
    assert {name: len(s) for name, s in seconds.items()} == {"a": 4, "b": 4, "c": 4}
    assert all(t >= 0 for s in seconds.values() for t in s)


def test_a_contender_of_unknown_kind_is_refused_by_name():
    with pytest.raises(ValueError, match="kind 'jax' is unknown; choose one of phalanx, ddp, zero, fsdp2, torch, ceiling, lockstep"):
        Variant(name="jax/2", kind="jax", num_procs=2, threads_per_proc=1, allocator_env=False)


def test_grad_dtype_adds_one_compressed_phalanx_contender_at_k():
    names = [v.name for v in variants((2,), cores=2, grad_dtype="bf16")]
    assert names[:6] == ["phalanx/1", "phalanx/2", "phalanx/2 gloo", "phalanx/2 overlapped", "phalanx/2 bound",
                         "phalanx/2 bf16"]
    compressed = {v.name: v for v in variants((2,), cores=2, grad_dtype="bf16")}["phalanx/2 bf16"]
    assert (compressed.num_procs, compressed.threads_per_proc, compressed.grad_dtype, compressed.algorithm,
            compressed.bind_cores) == (2, 1, "bf16", "auto", False)


def test_finite_check_cost_prices_the_default_check_against_none_and_every_step():
    by_name = {v.name: v for v in variants((2,), cores=2, finite_check_cost=True)}
    assert by_name["phalanx/2"].check_finite_every == 100  # DataParallel's default
    assert (by_name["phalanx/2 no finite check"].check_finite_every,
            by_name["phalanx/2 finite check every step"].check_finite_every) == (0, 1)
    assert by_name["phalanx/2 no finite check"].num_procs == 2
    assert "phalanx/2 no finite check" not in {v.name for v in variants((2,), cores=2)}


def test_wide_mlp_is_the_heavier_model():
    model = build_bench_model("mlp")
    assert isinstance(model, WideMLP)
    assert sum(p.numel() for p in model.parameters()) == 784 * 2048 + 2048 + 2048 * 2048 + 2048 + 2048 * 10 + 10
    assert model(torch.zeros(3, 1, 28, 28)).shape == (3, 10)
    assert sum(p.numel() for p in build_bench_model("lenet").parameters()) == 129_068
    with pytest.raises(ValueError):
        build_bench_model("vgg")


def _parse(*argv: str):
    return build_parser(["bench"]).parse_args(["bench", *argv])


def test_bench_flags_build_each_benchmarks_config():
    args = _parse("scaling", "--model", "mlp", "--devices", "3", "--batch-sizes", "64")
    assert (args.command, args.bench_name) == ("bench", "scaling")
    assert build(ScalingBenchConfig, args) == ScalingBenchConfig(model="mlp", device_counts=(3,), global_batch_sizes=(64,))
    config = build(ScalingBenchConfig, _parse("scaling", "--devices", "8,2,4"))
    assert (config.num_devices, config.phalanx_counts) == (8, (1, 2, 4, 8))
    args = _parse("allreduce", "--sizes", "4KB", "--out", "x")
    assert build(AllreduceBenchConfig, args) == AllreduceBenchConfig(sizes_bytes=(4096,))
    assert args.out_dir == "x"
    assert build(AllreduceBenchConfig, _parse("allreduce")) == AllreduceBenchConfig()
    assert build(OverlapBenchConfig, _parse("overlap")).device == "auto"


@pytest.mark.parametrize("argv, words", [
    (["bench"], "choose a benchmark"),
    (["bench", "allreduce", "--world-sizes", "1"], "--world-sizes 1"),
    (["bench", "allreduce", "--sizes", "4QB"], "4QB"),
    (["bench", "scaling", "--batch-sizes", "1", "--devices", "2"], "global batch"),
    (["bench", "scaling", "--side-by-side", "--grad-dtype", "bf16"], "run --grad-dtype"),
    (["bench", "overlap", "--algorithm", "gossip"], "gossip"),
])
def test_bad_bench_input_is_a_usage_error_before_any_work(argv, words, tmp_path):
    with pytest.raises(UsageError, match=words):
        run_bench(_parse(*argv[1:], *(["--out", str(tmp_path / "out")] if len(argv) > 1 else [])))
    assert not (tmp_path / "out").exists()  # nothing measured, nothing written


def test_out_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match="existing file"):
        prepare_out_dir(tmp_path / "file")
    assert prepare_out_dir(tmp_path / "a" / "b").is_dir()


def test_outputs_are_json_and_png(tmp_path):
    fig, axes = new_figure(2)
    assert len(axes) == 2
    axes[0].plot([1, 2], [3, 4])
    json_path, png_path = write_outputs(tmp_path, "demo", {"bench": "demo", "value_s": 1.5}, fig)
    assert json.loads(json_path.read_text()) == {"bench": "demo", "value_s": 1.5}
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.json", "demo.png"]  # no temp files left


def test_the_scaling_table_says_what_other_programs_took():
    from phalanx.bench.scaling_report import _load_lines
    assert _load_lines({"cores": 2}) == []  # an older payload, or off Linux
    assert _load_lines({"cores": 2, "others_cores": 0.1}) == ["other processes kept 0.1 of the 2 cores busy meanwhile"]
    assert _load_lines({"cores": 16, "others_cores": 0.1, "stolen_cores": 0.0}) == [
        "other processes kept 0.1 of the 16 cores busy meanwhile"]  # bare metal, or a VM alone on its host
    stolen = _load_lines({"cores": 16, "others_cores": 8.3, "stolen_cores": 6.0})[0]
    assert stolen.startswith("other processes kept 8.3 of the 16 cores busy meanwhile (6.0 of them stolen by the "
                             "hypervisor for other virtual machines): disturbed"), stolen
    disturbed = _load_lines({"cores": 2, "others_cores": 1.1})[0]
    assert disturbed.startswith("other processes kept 1.1 of the 2 cores busy meanwhile: disturbed")
    assert "a scaling efficiency above 1, phalanx above its ceiling: that load, not phalanx" in disturbed
