"""`bench step` and `bench gpu` without processes: configs, the refusal where no GPU is, the
contenders and the jobs they hand their fresh processes, the ratios and the check computed from
given records, the table and the chart. tests/distributed/test_bench_one_device.py runs bench
step for real; tests/gpu/test_cuda_graphs.py runs bench gpu's contenders on a GPU."""

from __future__ import annotations

import pytest
import torch

from phalanx.bench import gpu, gpu_report, step
from phalanx.cli import main
from phalanx.measure import one_device
from phalanx.measure.one_device import OneDeviceJob


def test_bench_gpu_refuses_in_one_line_where_no_gpu_is(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out"
    assert main(["bench", "gpu", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["phalanx: error: bench gpu needs a CUDA GPU, and torch sees none; `phalanx bench step` measures "
                   "the host time per step on this CPU"]
    assert not out.exists()
    assert main(["bench", "step", "--device", "cuda", "--out", str(out)]) == 2
    assert "bench step --device cuda needs a CUDA GPU" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("argv, words", [
    (["--variants", "fused,tf32"], "--variants fused,tf32: 'tf32' is unknown; choose one of fused, channels_last, bf16, compile"),
    (["--variants", "fused,fused"], "--variants fused,fused: name each one once"),
    (["--batch-size", "512", "--images", "100"], "--batch-size 512 is larger than --images 100"),
    (["--rounds", "0"], "--rounds 0 must be at least 1"),
])
def test_bench_gpu_bad_flags_are_one_line(argv, words, tmp_path, capsys):
    assert main(["bench", "gpu", *argv, "--out", str(tmp_path / "o")]) == 2
    assert words in capsys.readouterr().err


def test_the_contenders_are_the_five_anchors_and_the_variants_beside_the_captured_step():
    base, variants = gpu.contenders(gpu.GpuBenchConfig())
    assert list(base) == list(gpu.BASE)
    assert base["phalanx eager"] == OneDeviceJob(kind="phalanx", device="cuda")  # 60,000 images, batch 256
    assert base["phalanx graphs"].graphs and base["plain captured"].graphs and not base["plain"].graphs
    assert base["ddp/1"].kind == "ddp"
    assert list(variants) == ["phalanx graphs", "phalanx graphs + fused", "phalanx graphs + channels_last",
                              "phalanx graphs + bf16", "phalanx graphs + compile", "phalanx eager + compile"]
    assert variants["phalanx graphs + bf16"].bf16 and variants["phalanx graphs + bf16"].graphs
    assert not variants["phalanx eager + compile"].graphs and variants["phalanx eager + compile"].compile
    assert list(gpu.contenders(gpu.GpuBenchConfig(variants=("bf16",)))[1]) == ["phalanx graphs", "phalanx graphs + bf16"]
    assert gpu.contenders(gpu.GpuBenchConfig(variant_rounds=0))[1] == {}
    with pytest.raises(ValueError, match="a captured step needs a CUDA device"):
        OneDeviceJob(kind="plain", device="cpu", graphs=True)


def _record(images_per_s: float, graph: str | None = None, notes=()) -> dict:
    return {"wall_s": [1.0, 1.0], "host_s": [0.5, 0.5], "images": [images_per_s] * 2, "graph": graph,
            "notes": list(notes)}


def test_ratios_and_the_check_come_from_the_records(monkeypatch):
    rates = {"phalanx eager": 120, "phalanx graphs": 400, "plain": 130, "plain captured": 430, "ddp/1": 100,
             "phalanx graphs + fused": 440, "phalanx graphs + compile": 420, "phalanx eager + compile": 150}

    calls = {"anchors": 0}

    def fake_run(jobs, *, rounds, deadline_s, on_run=None):  # the anchors' 2nd round: 1 image/s more each
        r = calls["anchors"] if "plain" in jobs else 0
        calls["anchors"] += "plain" in jobs
        return {name: [_record(rates[name] + r, "replaying" if job.graphs else None)] for name, job in jobs.items()}

    monkeypatch.setattr(gpu, "run_contenders", fake_run)
    said: list[str] = []
    payload = gpu.run_gpu_bench(gpu.GpuBenchConfig(variants=("fused", "compile"), rounds=2, variant_rounds=1),
                                on_run=said.append)
    assert said == ["anchors round, images/s: phalanx eager 120, phalanx graphs 400, plain 130, plain captured 430, "
                    "ddp/1 100",
                    "variants round, images/s: phalanx graphs 400, phalanx graphs + fused 440, phalanx graphs + "
                    "compile 420, phalanx eager + compile 150",
                    "anchors round, images/s: phalanx eager 121, phalanx graphs 401, plain 131, plain captured 431, "
                    "ddp/1 101"]
    ratios = {r["metric"]: r["ratio"]["median"] for r in payload["ratios"]}
    assert ratios["phalanx_eager_vs_plain"] == pytest.approx((120 / 130 + 121 / 131) / 2)
    assert ratios["phalanx_graphs_vs_plain_captured"] == pytest.approx((400 / 430 + 401 / 431) / 2)
    assert ratios["phalanx graphs + fused_vs_phalanx_graphs"] == pytest.approx(440 / 400)
    assert ratios["phalanx eager + compile_vs_phalanx_graphs"] == pytest.approx(150 / 400)
    assert payload["check"] == {"passed": True, "problems": []} and payload["rounds_skipped"] == []
    assert [(r["contender"], r["rounds"]) for r in payload["results"]][:2] == [("phalanx eager", 2), ("phalanx graphs", 2)]
    text = gpu_report.report_gpu(payload)
    assert "phalanx_graphs_vs_plain" in text and "check: every captured phalanx run replayed its graph (0 s in all): passed" in text
    gpu_report.plot_gpu(payload)

    def fell_back(jobs, *, rounds, deadline_s, on_run=None):
        return {name: [_record(100, "eager" if job.graphs else None, ["CUDA graph step abandoned, running eagerly: x"])]
                for name, job in jobs.items()}

    monkeypatch.setattr(gpu, "run_contenders", fell_back)
    failed = gpu.run_gpu_bench(gpu.GpuBenchConfig(variant_rounds=0, rounds=1))["check"]
    assert not failed["passed"]
    assert failed["problems"][0] == "phalanx graphs: the captured step ran eager (CUDA graph step abandoned, running eagerly: x)"


def test_bench_step_reports_host_time_per_step_and_the_paired_ratio(monkeypatch):
    def fake_run(jobs, *, rounds, deadline_s, on_run=None):
        assert jobs["phalanx"].global_batch_size == 8 and jobs["phalanx"].num_images == 8 * 200
        assert jobs["plain"].threads == 1 and jobs["plain"].device == "cpu"
        host = {"phalanx": [0.21, 0.22], "plain": [0.2, 0.2]}
        return {name: [{"wall_s": [h * 2] * 2, "host_s": [h] * 2, "images": [1600] * 2} for h in host[name]]
                for name in jobs}

    monkeypatch.setattr(step, "run_contenders", fake_run)
    payload = step.run_step_bench(step.StepBenchConfig(rounds=2))
    assert payload["ratios"]["host_s"]["median"] == pytest.approx(1.075)
    assert payload["extra_host_us_per_step"]["median"] == pytest.approx(1e6 * 0.015 / 200)
    text = step.report_step(payload)
    assert "phalanx's step / the plain loop's: host 1.075" in text and "75 (50-100) us more host time" in text
    step.plot_step(payload)


def test_rounds_run_most_telling_first_and_stop_at_the_budget(monkeypatch):
    config = gpu.GpuBenchConfig(variants=("bf16",), rounds=3, variant_rounds=2, budget_s=100)
    assert gpu.plan_rounds(config, {"variants": {"x": None}}) == ["anchors", "variants", "variants", "anchors",
                                                                    "anchors"]
    now, seen = [0.0], []

    def fake_run(jobs, *, rounds, deadline_s, on_run=None):  # every process takes 6 s
        now[0] += 6 * len(jobs)
        seen.append(sorted(jobs))
        return {name: [_record(100, "replaying" if job.graphs else None)] for name, job in jobs.items()}

    monkeypatch.setattr(gpu, "run_contenders", fake_run)
    payload = gpu.run_gpu_bench(config, clock=lambda: now[0])
    # anchors (5 x 6 = 30 s), variants (2 x 6: 42 s), variants (54 s), anchors (84 s); the last anchors would end at 114 s
    assert len(seen) == 4 and payload["rounds_skipped"] == ["anchors"] and payload["elapsed_s"] == 84
    assert {r["contender"]: r["rounds"] for r in payload["results"] if r["group"] == "anchors"}["plain"] == 2
    assert "not started within the 100 s budget: 1 round(s) of anchors" in gpu_report.report_gpu(payload)


def test_bench_gpu_reads_the_plain_loops_own_records(monkeypatch):
    # The device's first bench gpu failed on a KeyError: the fakes above gave every record phalanx's
    # keys, the plain loop's (and DDP's, the same loop) had none. One real record, here on the CPU.
    job = OneDeviceJob(kind="plain", device="cpu", num_images=64, global_batch_size=32, warmup_epochs=0, epochs=1)
    record = one_device._plain_fresh(rank=0, num_procs=1, port=0, job=job)
    assert record["images"] == [64] and record["graph"] is None and record["notes"] == []

    def fake_run(jobs, *, rounds, deadline_s, on_run=None):
        return {name: [_record(100, "replaying") if job.kind == "phalanx" and job.graphs else
                       _record(100) if job.kind == "phalanx" else
                       {**record, "graph": "replaying" if job.graphs else None}] for name, job in jobs.items()}

    monkeypatch.setattr(gpu, "run_contenders", fake_run)
    payload = gpu.run_gpu_bench(gpu.GpuBenchConfig(variant_rounds=0, rounds=1))
    assert payload["check"] == {"passed": True, "problems": []}
    assert {r["contender"]: r["graph"] for r in payload["results"]}["plain captured"] == ["replaying"]
