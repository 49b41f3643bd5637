"""`bench autopar --device cuda`: streams, the GPU-copy-CPU pipeline and the streams + events
scheduler, at tiny sizes; skipped where no GPU is present. Correctness and bookkeeping only,
no timed assertions (the numbers go to docs/autopar.md from a run of the bench itself).
"""

from __future__ import annotations

import json

import pytest
import torch

from phalanx.bench.cli import run_bench
from phalanx.cli import build_parser
from phalanx.autopar.cuda import measure_pipeline, measure_streams
from phalanx.autopar.cuda_graph import measure_cuda_mlp, run_on_streams
from phalanx.autopar.graphs import HOST, MLPProgram
from phalanx.autopar.taskgraph import run_in_sequence, violations
from phalanx.autopar.taskgraph_program import program_graph
from phalanx.measure.timing import synchronize_cuda

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_products_on_several_streams_equal_one_stream_bitwise(tmp_path):
    m = measure_streams(size=64, count=6, streams=3, rounds=2, target_s=1e-3, dtype="float32", each_alone=True,
                        trace=(str(tmp_path), "exp1"))
    assert m["check"]["passed"]
    assert set(m["samples"]) == {"eager", "concurrent", "batched", "each alone, summed", "share 0 alone",
                                 "share 1 alone", "share 2 alone"}
    assert (tmp_path / "exp1.json").exists() and (tmp_path / "exp1.png").exists()


def test_gpu_copy_cpu_pipeline_matches_in_sequence(tmp_path):
    m = measure_pipeline(chunks=5, chunk_rows=64, width=16, rounds=2, dtype="float64", trace_dir=str(tmp_path), depth=3)
    assert m["check"]["passed"]
    assert len(m["measured_s"]) == len(m["ideal_s"]) == len(m["sequential_s"]) == 2
    for r in range(2):
        stages = {name: m["stages_s"][name][r] for name in ("compute", "transfer", "reduce")}
        assert m["sequential_s"][r] == pytest.approx(5 * sum(stages.values()))
    assert (tmp_path / "exp3.json").exists()


def _devices():
    return (torch.device("cuda:0"), torch.device("cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"))


def test_streams_and_events_scheduler_gives_the_sequential_weights_bitwise():
    program = MLPProgram(batch_size=8, in_features=6, hidden=5, out_features=3, steps=3, dtype=torch.float64,
                         devices=_devices())
    graph = program_graph(program.program())
    program.reset()
    run_in_sequence(graph, after_each=synchronize_cuda)
    want = program.parameters()
    streams = {"device0": torch.cuda.Stream(device=_devices()[0]), "device1": torch.cuda.Stream(device=_devices()[1]),
               HOST: None}
    program.reset()
    schedule, same_clock = run_on_streams(graph, streams, deadline_s=60)
    got = program.parameters()
    assert all(torch.equal(want[name], got[name]) for name in want)
    assert violations(graph, schedule, edges=same_clock) == []
    assert len(same_clock) > 0 and set(schedule.spans) == set(graph.tasks)
    cpu = MLPProgram(batch_size=8, in_features=6, hidden=5, out_features=3, steps=3, dtype=torch.float64)
    run_in_sequence(program_graph(cpu.program()))
    for name, value in cpu.parameters().items():  # the same SGD as on CPU, up to kernel rounding
        torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-12)


def test_experiment_5_on_cuda_passes_its_checks(tmp_path):
    m = measure_cuda_mlp(batch_size=8, in_features=6, hidden=5, out_features=3, steps=2, rounds=2, dtype="float64",
                         deadline_s=60, trace_dir=str(tmp_path))
    assert m["check"]["passed"] and m["check"]["problems"] == []
    assert len(m["rounds"]) == 2 and all(r["ideal_s"] > 0 for r in m["rounds"])
    assert (tmp_path / "exp5.json").exists()


def test_autopar_bench_cuda_smoke(tmp_path, capsys):
    parser = build_parser(["bench"])
    args = parser.parse_args(["bench", "autopar", "--device", "cuda", "--rounds", "2", "--matrix-size", "64",
                              "--matmuls", "4", "--sizes", "32,64", "--target-ms", "1", "--chunks", "3",
                              "--chunk-rows", "64", "--width", "16", "--batch-size", "8", "--hidden", "8",
                              "--steps", "2", "--out", str(tmp_path)])
    assert run_bench(args) == 0
    payload = json.loads((tmp_path / "autopar.json").read_text())
    assert payload["config"]["device"] == "cuda" and payload["checks_passed"]
    assert [e["experiment"] for e in payload["experiments"]] == [1, 2, 3, 5]
    assert capsys.readouterr().out.count("verdict: ") == 4
