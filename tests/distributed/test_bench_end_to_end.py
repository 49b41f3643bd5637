"""Each benchmark end to end through the real spawn path (2 gloo workers), with minimal sizes and
steps: machinery, not speed. Checks the table, the JSON schema, that the numbers hang together
(busbw = algbw x 2(k-1)/k, sum of parts = the parts), and that the PNG exists. Plus the fresh-
process runner the non-phalanx contenders start through: environment, threads, failures.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from phalanx.bench.cli import run_bench
from phalanx.cli import build_parser
from phalanx.measure.mlp import build_bench_model
from phalanx.measure.procs import run_fresh
from phalanx.runtime.binding import available_cores
from tests.distributed.allocator_probe import keeps_large_blocks_off_mmap

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
pytestmark = pytest.mark.usefixtures("smoke_sized_cores")  # see tests/distributed/conftest.py


def _run(argv: list[str], out_dir) -> tuple[dict, str]:
    parser = build_parser(["bench"])
    assert run_bench(parser.parse_args(argv + ["--out", str(out_dir)])) == 0
    name = argv[1]
    assert (out_dir / f"{name}.png").read_bytes()[:8] == PNG_MAGIC
    return json.loads((out_dir / f"{name}.json").read_text()), name


def _is_spread(value: dict, rounds: int) -> bool:
    samples = value["samples"]
    return (set(value) == {"median", "min", "max", "samples"} and len(samples) == rounds
            and value["min"] == min(samples) and value["max"] == max(samples) and value["min"] <= value["median"])


@pytest.mark.distributed
def test_allreduce_bench_smoke(tmp_path, capsys):
    payload, _ = _run(["bench", "allreduce", "--sizes", "4KB,64KB", "--world-sizes", "2",
                       "--algorithms", "native,shm,ring", "--collectives", "allreduce,reduce-scatter",
                       "--rounds", "2"], tmp_path)
    assert payload["bench"] == "allreduce"
    assert [(r["size_bytes"], r["collective"], r["algorithm"]) for r in payload["results"]] == [
        (size, collective, algo) for size in (4096, 65536) for collective in ("allreduce", "reduce-scatter")
        for algo in ("native", "shm", "ring")]
    for row in payload["results"]:
        assert row["world_size"] == 2 and row["calls_per_batch"] >= 1
        assert all(_is_spread(row[key], 2) for key in ("time_s", "algbw_GBps", "busbw_GBps"))
        factor = 2 * (2 - 1) / 2 if row["collective"] == "allreduce" else (2 - 1) / 2
        for t, algbw, busbw in zip(row["time_s"]["samples"], row["algbw_GBps"]["samples"],
                                   row["busbw_GBps"]["samples"]):
            assert algbw == pytest.approx(row["size_bytes"] / t / 1e9)
            assert busbw == pytest.approx(algbw * factor)
    assert [m["size_bytes"] for m in payload["memcpy"]] == [4096, 65536]
    assert all(_is_spread(m["time_s"], 2) for m in payload["memcpy"])
    assert [(r["size_bytes"], r["collective"], r["algorithm"]) for r in payload["ratios"]] == [
        (size, collective, algo) for size in (4096, 65536) for collective in ("allreduce", "reduce-scatter")
        for algo in ("shm", "ring")]
    assert [(r["size_bytes"], r["algorithm"]) for r in payload["halves"]] == [
        (size, algo) for size in (4096, 65536) for algo in ("native", "shm", "ring")]
    out = capsys.readouterr().out
    assert "shm / native busbw, allreduce, on 2 processes" in out and "ring / native busbw, reduce-scatter" in out
    assert "shm reduce-scatter time / shm allreduce time on 2 processes: 4KB" in out and "memcpy reference" in out


@pytest.mark.distributed
def test_overlap_bench_smoke(tmp_path, capsys):
    payload, _ = _run(["bench", "overlap", "--device", "cpu", "--matrix-size", "64", "--matmuls", "2",
                       "--transfer-mb", "0.25", "--rounds", "2"], tmp_path)
    assert payload["bench"] == "overlap" and payload["config"]["device"] == "cpu"
    experiments = {e["experiment"]: e for e in payload["experiments"]}
    assert set(experiments) == {"a", "b"}
    assert set(experiments["a"]["parts_s"]) == {"device 0 alone", "device 1 alone"}
    assert set(experiments["b"]["parts_s"]) == {"compute", "allreduce"}
    for exp in experiments.values():
        parts = [p["samples"] for p in exp["parts_s"].values()]
        assert exp["sum_of_parts_s"]["samples"] == pytest.approx([sum(r) for r in zip(*parts)])
        ratios = [s / t for s, t in zip(exp["sum_of_parts_s"]["samples"], exp["together_s"]["samples"])]
        assert exp["sum_of_parts_over_together"]["samples"] == pytest.approx(ratios)
        assert _is_spread(exp["together_s"], 2)
    assert "sum of parts / together" in capsys.readouterr().out


@pytest.mark.distributed
def test_scaling_bench_smoke(tmp_path, capsys, smoke_sized_cores):
    payload, _ = _run(["bench", "scaling", "--batch-sizes", "8,12", "--devices", "2", "--steps", "1",
                       "--warmup-steps", "1", "--rounds", "1"], tmp_path)
    assert payload["cores"] <= smoke_sized_cores
    assert all(v["threads_per_proc"] <= smoke_sized_cores for v in payload["variants"])
    names = [v["name"] for v in payload["variants"]]
    bound = ["phalanx/2 bound"] if payload["cores"] >= 2 else []  # --bind-cores needs a core per worker
    assert names[:8 + len(bound)] == ["phalanx/1", "phalanx/2", "phalanx/2 gloo", "phalanx/2 overlapped", *bound,
                                      "ddp/2", "ddp/2 tuned", "ceiling/2", "ceiling/2 lockstep"]
    assert "torch 1 thread" in names
    assert [(r["global_batch_size"], r["variant"]) for r in payload["results"]] == [
        (batch, name) for batch in (8, 12) for name in names]
    assert all(r["images_per_s"]["median"] > 0 for r in payload["results"])
    for batch in (8, 12):
        assert {r["metric"] for r in payload["ratios"] if r["global_batch_size"] == batch} == {
            "phalanx_vs_gloo_exchange", "phalanx_vs_ddp", "phalanx_vs_ddp_same_setup",
            "phalanx_vs_best_single_process", "phalanx_vs_best_single_process_same_setup", "phalanx_vs_ceiling",
            "phalanx_vs_lockstep_ceiling", "lockstep_vs_ceiling", "phalanx_1_device_vs_plain_loop_same_setup",
            "speedup", "scaling_efficiency", "overlapped_vs_default", *(["bound_cores_vs_unbound"] if bound else [])}
    per = {r["variant"]: r["images_per_s"]["median"] for r in payload["results"] if r["global_batch_size"] == 8}
    ratio = {r["metric"]: r["ratio"]["median"] for r in payload["ratios"] if r["global_batch_size"] == 8}
    assert ratio["scaling_efficiency"] == pytest.approx(per["phalanx/2"] / (2 * per["phalanx/1"]))
    assert ratio["speedup"] == pytest.approx(per["phalanx/2"] / per["phalanx/1"])
    assert ratio["phalanx_vs_ddp"] == pytest.approx(per["phalanx/2"] / per["ddp/2"])
    # The ceiling ratio is the product of what the exchange costs and what lockstep costs.
    assert ratio["phalanx_vs_lockstep_ceiling"] * ratio["lockstep_vs_ceiling"] == pytest.approx(
        ratio["phalanx_vs_ceiling"])
    one = next(r for r in payload["ratios"] if r["metric"] == "phalanx_1_device_vs_plain_loop_same_setup")
    assert one["against"].endswith("tuned") and one["ratio"]["median"] == pytest.approx(
        per["phalanx/1"] / per[one["against"]])
    # One start per contender runs both batch sizes: the same start's wall time for each.
    wall = {(r["global_batch_size"], r["variant"]): r["wall_s"]["samples"] for r in payload["results"]}
    assert all(wall[8, name] == wall[12, name] and wall[8, name][0] > 0 for name in names)
    captured = capsys.readouterr()
    assert "phalanx_vs_ddp" in captured.out
    # What other programs took meanwhile is measured and said (a disturbed table says what it means).
    assert payload["others_cores"] is not None and payload["others_cores"] >= 0
    assert f"other processes kept {payload['others_cores']:.1f} of the {payload['cores']} cores busy" in captured.out
    # Each contender's row on stderr as it completes (both batch sizes in it), before the table.
    rows = [line for line in captured.err.splitlines() if "images/s (" in line]
    assert len(rows) == len(names) and rows[0].startswith("phalanx bench: [1/")
    assert "phalanx/1, global batch 8: " in rows[0] and ", global batch 12: " in rows[0]


@pytest.mark.distributed
def test_scaling_bench_side_by_side_smoke(tmp_path, capsys, smoke_sized_cores):
    payload, _ = _run(["bench", "scaling", "--side-by-side", "--batch-sizes", "8,12", "--devices", "2", "--steps", "1",
                       "--warmup-steps", "1", "--rounds", "1", "--blocks", "3"], tmp_path)
    cores = payload["cores"]
    tuned = f"torch {cores} thread{'s' if cores > 1 else ''} tuned"
    names = [v["name"] for v in payload["variants"]]
    assert payload["method"] == "side by side"
    assert names == ["phalanx/2", "phalanx/2 overlapped", "ceiling/2", "ceiling/2 lockstep", "ddp/2 tuned", "phalanx/1",
                     tuned]
    for batch in (8, 12):
        samples = {r["variant"]: r["images_per_s"]["samples"] for r in payload["results"]
                   if r["global_batch_size"] == batch}
        assert {name: len(s) for name, s in samples.items()} == {name: 3 for name in names}  # a sample a block
        ratios = {r["metric"]: r for r in payload["ratios"] if r["global_batch_size"] == batch}
        assert set(ratios) == {"phalanx_vs_ddp_same_setup", "phalanx_vs_best_single_process_same_setup",
                               "phalanx_vs_ceiling", "phalanx_vs_lockstep_ceiling", "lockstep_vs_ceiling",
                               "phalanx_1_device_vs_plain_loop_same_setup", "speedup", "scaling_efficiency",
                               "overlapped_vs_default"}
        # Per-block ratios: each block of phalanx against the same block of its yardstick.
        for metric, a, b in (("phalanx_vs_ceiling", "phalanx/2", "ceiling/2"),
                             ("phalanx_vs_ddp_same_setup", "phalanx/2", "ddp/2 tuned"),
                             ("overlapped_vs_default", "phalanx/2 overlapped", "phalanx/2"),
                             ("phalanx_1_device_vs_plain_loop_same_setup", "phalanx/1", tuned)):
            assert ratios[metric]["ratio"]["samples"] == pytest.approx([x / y for x, y in zip(samples[a], samples[b])])
        exchange, lockstep = (ratios[m]["ratio"]["samples"]
                              for m in ("phalanx_vs_lockstep_ceiling", "lockstep_vs_ceiling"))
        assert [x * y for x, y in zip(exchange, lockstep)] == pytest.approx(
            ratios["phalanx_vs_ceiling"]["ratio"]["samples"])
    # Two starts, each running every batch size: one row each on stderr as it completes.
    captured = capsys.readouterr()
    rows = [line for line in captured.err.splitlines() if "side by side on" in line]
    assert len(rows) == 2 and rows[0].startswith("phalanx bench: [1/2] side by side on 2 x ")
    assert "global batch 8: phalanx/2 " in rows[0] and "global batch 12: phalanx/2 " in rows[0]
    assert "3 blocks side by side" in captured.out and "phalanx_vs_lockstep_ceiling" in captured.out


def count_lockstep_meetings(world, jobs, lockstep):
    """The ceiling's worker with AsyncComm.allreduce counted: (tensor sizes it summed, records)."""
    from phalanx.comm import AsyncComm
    from phalanx.measure import step

    sizes, allreduce = [], AsyncComm.allreduce

    def counted(self, tensor, **kwargs):
        sizes.append(tensor.numel())
        return allreduce(self, tensor, **kwargs)

    AsyncComm.allreduce = counted
    return sizes, step._ceiling_worker(world, jobs, lockstep=lockstep)


@pytest.mark.distributed
def test_the_lockstep_ceiling_meets_at_every_step_and_the_ceiling_never():
    from phalanx.measure.job_steps import StepJob
    from phalanx.runtime.devices import parse_devices
    from phalanx.runtime.launch import LaunchSpec, launch

    jobs = tuple(StepJob(model="lenet", global_batch_size=batch, warmup_steps=2, steps=3, lr=0.2, seed=0,
                         num_shards=2, threads_per_device=1) for batch in (8, 12))
    spec = LaunchSpec(plan=parse_devices("cpu:2", cuda_count=0), threads_per_device=1, timeout_s=60, deadline_s=120)
    for lockstep, meetings in ((True, 2 * (2 + 3)), (False, 0)):
        for sizes, records in launch(count_lockstep_meetings, jobs, lockstep, spec=spec):
            assert sizes == [1] * meetings  # one 1-element allreduce per step, warm-up included
            assert len(records) == 2 and all(record["wall_s"] > 0 for record in records)


def record_meetings_and_spins(world, jobs, kinds):
    """side_by_side's worker with AsyncComm.allreduce's sizes and each shm group's spin recorded."""
    from phalanx.comm import AsyncComm, shm
    from phalanx.measure import side_by_side

    sizes, spins, allreduce, opened = [], [], AsyncComm.allreduce, shm.ShmGroup._opened

    def counted(self, tensor, **kwargs):
        sizes.append(tensor.numel())
        return allreduce(self, tensor, **kwargs)

    def noted(self):
        spins.append(self.spin_s)
        return opened(self)

    AsyncComm.allreduce, shm.ShmGroup._opened = counted, noted
    side_by_side._worker(world, jobs, kinds, 2)
    return sizes, spins, shm.SPIN_S


@pytest.mark.distributed
@pytest.mark.skipif(available_cores() < 2, reason="2 workers on 1 core never spin (shm.py): nothing to lengthen")
def test_the_gradient_sized_twin_meets_through_a_gradients_worth_and_long_spin_spins_a_millisecond():
    # tools/gap_probe.py's split of phalanx's wait: the collective alone (the twin meeting through
    # as many floats as LeNet's gradient) and phalanx with waits spinning 1 ms before they sleep.
    from phalanx.measure.job_steps import StepJob
    from phalanx.measure.side_by_side import LONG_SPIN_S
    from phalanx.comm.shm_flags import SPIN_S
    from phalanx.runtime.devices import parse_devices
    from phalanx.runtime.launch import LaunchSpec, launch

    job = StepJob(model="lenet", global_batch_size=8, warmup_steps=1, steps=2, lr=0.2, seed=0, num_shards=2,
                  threads_per_device=1)
    spec = LaunchSpec(plan=parse_devices("cpu:2", cuda_count=0), threads_per_device=1, timeout_s=60, deadline_s=120)
    gradient = sum(p.numel() for p in build_bench_model("lenet").parameters())
    for sizes, spins, spin_after in launch(record_meetings_and_spins, (job,), ("lockstep-full", "long-spin"),
                                           spec=spec):
        meetings = [n for n in sizes if n == gradient]
        assert len(meetings) == 1 + 2 * 2, sizes  # a meeting a step: 1 warm-up, 2 blocks of 2
        # The twin's comm spins as phalanx's does; the long-spin replica's group 1 ms; SPIN_S restored.
        assert spins[0] == SPIN_S and LONG_SPIN_S in spins[1:] and spin_after == SPIN_S, spins


def report_setup(*, rank, num_procs, port, job):
    setup = (rank, num_procs, torch.get_num_threads(), keeps_large_blocks_off_mmap())
    if job == "fail":
        raise ValueError(f"gives up with setup {setup}")
    return setup


@pytest.mark.distributed
def test_fresh_processes_get_the_environment_and_threads_asked_for(monkeypatch):
    # One process each (two-process runs are covered by the scaling smoke's ddp/2).
    for key in [key for key in os.environ if key.startswith("MALLOC_")]:  # a user's own setting would win
        monkeypatch.delenv(key)
    assert run_fresh(report_setup, None, num_procs=1, threads=1, tune_allocator=True, deadline_s=60) == [
        (0, 1, 1, True)]
    assert "MALLOC_MMAP_MAX_" not in os.environ  # the parent's environment is left alone
    # A plain user's process: no allocator setting; a failure names the rank and the error.
    with pytest.raises(RuntimeError, match=r"rank 0 failed: ValueError: gives up with setup \(0, 1, 2, False\)"):
        run_fresh(report_setup, "fail", num_procs=1, threads=2, tune_allocator=False, deadline_s=60)


@pytest.mark.distributed
def test_a_core_left_contender_runs_beside_phalanx_in_the_same_workers():
    # 16 cores give 8 workers 2 threads each, so side by side times phalanx/8 at 1 thread in the
    # same processes; here 2 workers of 2 threads run it at 1 (the 2 cores oversubscribed: a smoke).
    from phalanx.measure.job_steps import StepJob
    from phalanx.measure.side_by_side import run_side_by_side

    job = StepJob(model="lenet", global_batch_size=8, warmup_steps=1, steps=1, lr=0.1, seed=0, num_shards=2,
                  threads_per_device=2, memory_format="auto")
    (result,) = run_side_by_side([job], ["phalanx", "core-left"], num_procs=2, threads_per_proc=2, blocks=2,
                                 timeout_s=60, deadline_s=120)
    seconds = result.seconds
    assert set(seconds) == {"phalanx", "core-left"} and all(len(s) == 2 and min(s) > 0 for s in seconds.values())
    # Where each step went (measure/phases.py): every phase timed, the exchange in "wait", and the
    # phases of a step within its block's time (the ranks' mean against the slowest rank's block).
    for kind, phase_ms in result.phase_ms.items():
        assert list(phase_ms) == ["forward", "backward", "wait", "optimizer", "other"], kind
        assert min(phase_ms[p] for p in ("forward", "backward", "wait", "optimizer")) > 0, (kind, phase_ms)
        assert sum(phase_ms.values()) <= max(seconds[kind]) * 1e3 / job.steps * 1.001, (kind, phase_ms)
