"""Whole epochs through the captured step, on the CPU with a stand-in graph (tests/unit/graph_stand_in.py):
`train_epoch(graph=captured_train_step(...))` over 2 epochs with an uneven last batch ends
bitwise where the eager epochs end, with the same loss and accuracy; the NaN/Inf check still
fires between replays; and `phalanx train`'s job, handed the stand-in for its CUDA graph, names
the capture in its first line and trains as eagerly. What the GPU alone can show (a real
capture, its speed, float64 against eager to 1e-9) is tests/gpu/test_cuda_graphs.py's."""

from __future__ import annotations

import pytest
import torch

from phalanx.data_parallel import prepare
from phalanx.data_parallel.guards.checks import NonFinite
from phalanx.data_parallel.strategy import DataSplit
from phalanx.models import LeNet
from phalanx.runtime.world import World
from phalanx.train.loop import captured_train_step, train_epoch
from tests.unit.graph_stand_in import RecordedGraph

WORLD1 = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), backend="none",
               timeout_s=10.0)


def _data(n: int = 150):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n, 1, 28, 28), dtype=torch.uint8, generator=g), torch.randint(0, 10, (n,), generator=g)


def _train(graphs: bool, *, epochs: int = 2, check_every: int = 100, poison_at: int | None = None):
    images, labels = _data()
    torch.manual_seed(0)
    dp = prepare(LeNet(), world=WORLD1, dtype="float64", check_finite_every=check_every)
    strategy = DataSplit(dp)
    optimizer = strategy.make_optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
    lines, graph, backend = [], None, RecordedGraph(quiet=dp.capturing)
    if graphs:
        graph = captured_train_step(strategy, optimizer, images, labels, global_batch_size=32, backend=backend,
                                    say=lines.append, warmup_steps=2)
    if poison_at is not None:  # after that step, a NaN weight
        def after(done, total, loss_sum, totals):
            if done == poison_at:
                dp.module.conv1.weight.data[0, 0, 0, 0] = float("nan")
    stats = [train_epoch(strategy, optimizer, images, labels, world=WORLD1, global_batch_size=32, seed=0, epoch=e,
                         graph=graph, after_step=after if poison_at is not None else None) for e in range(epochs)]
    return [p.detach().clone() for p in dp.parameters()], stats, graph, backend, lines, dp


def test_captured_epochs_end_bitwise_where_eager_epochs_end():
    eager_params, eager_stats, *_ = _train(False)
    params, stats, graph, backend, lines, dp = _train(True)
    assert lines == [] and graph.state == "replaying"
    # 150 images in batches of 32: 4 full batches and one of 22 a epoch; 2 warm-up, 1 checked, 5 replayed
    assert backend.warm_steps == 2 and backend.captures == 1 and backend.replays == 6
    assert all(torch.equal(a, b) for a, b in zip(params, eager_params))
    for got, want in zip(stats, eager_stats):
        assert (got.train_loss, got.train_acc, got.num_examples) == (want.train_loss, want.train_acc, want.num_examples)
    assert dp._synced_steps == 10  # every step once: eager, checked, replayed


def test_the_nan_check_runs_between_replays():
    with pytest.raises(NonFinite, match=r"gradient NaN/Inf at one of steps 5-6"):
        _train(True, check_every=2, poison_at=5)


def test_the_job_names_the_capture_in_its_first_line_and_trains_as_eagerly(tmp_path, idx_dir, capsys, monkeypatch):
    from phalanx.cli import main
    from phalanx.job.config import TrainConfig
    from phalanx.telemetry.metrics import read_metrics
    from phalanx.train.graph_plan import GraphPlan

    # 3,000 images in batches of 512: 5 full ones (3 warm-up, 1 checked, 1 replayed) and one of 440.
    args = ["train", "--devices", "cpu:1", "--data-dir", str(idx_dir), "--epochs", "1", "--no-progress",
            "--batch-size", "512"]
    assert main([*args, "--out", str(tmp_path / "eager")]) == 0
    eager_line = capsys.readouterr().out.splitlines()[0]
    assert "CUDA graph" not in eager_line and "eager step" not in eager_line  # a CPU run on auto says nothing
    # As on one GPU: the plan captures, and the graph is the stand-in.
    monkeypatch.setattr(TrainConfig, "graph_plan", lambda self, device_type, num_devices, backend="nccl": GraphPlan(
        mode="auto", capture=True, reason=None, device_type="cuda"))
    monkeypatch.setattr("phalanx.job.job.CudaGraph", lambda device: RecordedGraph())
    assert main([*args, "--out", str(tmp_path / "graphs")]) == 0
    out = capsys.readouterr().out
    assert "step captured as one CUDA graph (each full batch; the smaller last batch eager)" in out.splitlines()[0]
    assert "abandoned" not in out
    eager, graphs = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("eager", "graphs"))
    for a, b in zip(eager, graphs):
        assert (a["train_loss"], a["train_acc"], a["test_acc"]) == (b["train_loss"], b["train_acc"], b["test_acc"])
    want, got = (torch.load(tmp_path / name / "model.pt", weights_only=True) for name in ("eager", "graphs"))
    assert all(torch.equal(want[k], got[k]) for k in want)
