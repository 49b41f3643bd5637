"""The captured step on a real GPU (skipped without CUDA): float64 graphs vs eager after 2 epochs of
the sample (uneven last batch) within 1e-9, float64 cuda:0 vs cpu:1 within 1e-9 (one input
conversion everywhere), replays under set_sync_debug_mode("error"), a capture that raises falling
back in one line (torch's generator and stream put back: the dropout masks after it are those of a
run that never tried), BatchNorm and Adam captured, the refusals named in the first log line, and
bench gpu's contenders each running. The same bookkeeping is tested on the CPU with a stand-in
graph (tests/unit/test_cuda_graphs.py, tests/distributed/test_cuda_graph_stand_in.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from phalanx.cli import main
from phalanx.data import to_float
from phalanx.data_parallel import prepare
from phalanx.data_parallel.strategy import DataSplit
from phalanx.measure.one_device import OneDeviceJob, run_one_device
from phalanx.models import LeNet
from phalanx.runtime.world import World
from phalanx.train.graphs import CapturedStep, CudaGraph
from phalanx.train.loop import captured_train_step, train_epoch
from tests.unit.api_doc import API_DOC, REPO, python_blocks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CUDA = torch.device("cuda", 0)
WORLD = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=CUDA, backend="none", timeout_s=30.0)


def _train(tmp_path, idx_dir, name: str, *extra: str) -> tuple[dict, str]:
    out = tmp_path / name
    code = main(["train", "--data-dir", str(idx_dir), "--epochs", "2", "--dtype", "float64", "--no-progress",
                 "--out", str(out), *extra])
    assert code == 0
    return torch.load(out / "model.pt", weights_only=True), str(out)


def _relative(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)) for k in b
               if b[k].is_floating_point())


def test_float64_graphs_equal_eager_and_cpu_within_1e_9(tmp_path, idx_dir, capsys):
    graphs, _ = _train(tmp_path, idx_dir, "graphs", "--devices", "cuda:0", "--cuda-graphs", "on")
    first = capsys.readouterr().out.splitlines()[0]
    assert "step captured as one CUDA graph" in first
    eager, _ = _train(tmp_path, idx_dir, "eager", "--devices", "cuda:0", "--cuda-graphs", "off")
    assert "eager step (--cuda-graphs off)" in capsys.readouterr().out.splitlines()[0]
    cpu, _ = _train(tmp_path, idx_dir, "cpu", "--devices", "cpu:1")
    out = capsys.readouterr().out
    assert "abandoned" not in out
    # 3,000 images at 256: 11 full batches (3 warm-up, 1 checked, 7 replayed in epoch 1) and one of 184.
    assert _relative(graphs, eager) < 1e-9
    assert _relative(eager, cpu) < 1e-9  # was 1.75e-7 when the two devices converted the images differently


def test_images_become_the_same_floats_on_the_gpu_and_the_cpu():
    x = torch.arange(256, dtype=torch.uint8)
    for dtype in (torch.float32, torch.float64):
        assert torch.equal(to_float(x.to(CUDA), dtype).cpu(), to_float(x, dtype))


def test_replays_read_nothing_on_the_host():
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (1000, 1, 28, 28), dtype=torch.uint8, generator=gen).to(CUDA)
    labels = torch.randint(0, 10, (1000,), generator=gen).to(CUDA)
    torch.manual_seed(0)
    dp = prepare(LeNet(), world=WORLD)
    strategy = DataSplit(dp)
    optimizer = strategy.make_optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
    lines = []
    graph = captured_train_step(strategy, optimizer, images, labels, global_batch_size=128, backend=CudaGraph(CUDA),
                                say=lines.append)
    for epoch in range(2):  # 7 full batches and one of 104: warm-up, capture and check in epoch 1
        train_epoch(strategy, optimizer, images, labels, world=WORLD, global_batch_size=128, seed=0, epoch=epoch,
                    graph=graph)
    assert graph.state == "replaying" and lines == []

    def on_step(done: int, total: int) -> None:
        if done == total:
            torch.cuda.set_sync_debug_mode("default")

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        stats = train_epoch(strategy, optimizer, images, labels, world=WORLD, global_batch_size=128, seed=0, epoch=2,
                            graph=graph, on_step=on_step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert stats.num_examples == 1000 and 0 < stats.train_loss < 10
    dp.close()


def test_a_capture_that_raises_runs_eagerly_and_says_so():
    torch.manual_seed(0)
    model = LeNet().to(CUDA)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 1, 28, 28, device=CUDA)
    y = torch.randint(0, 10, (16,), device=CUDA)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        if loss.item() > 1e9:  # a host read: illegal while a stream is capturing
            raise AssertionError("unreachable")
        loss.backward()
        optimizer.step()
        return (loss.detach(),)

    lines = []
    captured = CapturedStep(step, inputs=(x, y), module=model, optimizer=optimizer, backend=CudaGraph(CUDA),
                            warmup_steps=1, say=lines.append)
    for _ in range(4):
        captured(x, y)
    assert captured.state == "eager" and len(lines) == 1
    assert lines[0].startswith("CUDA graph step abandoned, running eagerly: capturing the step raised")


def _dropout_steps(*, capture: bool) -> tuple[list[float], list[str]]:
    """Four steps of a small dropout network, through CapturedStep with a capture that raises (a
    host read), or running eagerly from the start; the losses and the lines it said."""
    torch.manual_seed(0)
    torch.cuda.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 64), torch.nn.Dropout(0.5),
                                torch.nn.Linear(64, 10)).to(CUDA)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 1, 28, 28, device=CUDA), torch.randint(0, 10, (16,), device=CUDA)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)  # a dropout mask drawn from the device's generator
        if loss.item() > 1e9:  # a host read: illegal while a stream is capturing
            raise AssertionError("unreachable")
        loss.backward()
        optimizer.step()
        return (loss.detach(),)

    lines: list[str] = []
    captured = CapturedStep(step, inputs=(x, y), module=model, optimizer=optimizer, warmup_steps=1, say=lines.append,
                            backend=CudaGraph(CUDA) if capture else None, eager_reason=None if capture else "eager")
    return [captured(x, y)[0].item() for _ in range(4)], lines


def test_after_a_capture_that_raises_random_draws_go_on_as_if_none_was_tried():
    # torch leaves the device's generator flagged as capturing after a capture that raised: every
    # later draw raised "Offset increment outside graph capture" (the BatchNorm unit cases after this
    # file in one pytest worker, on 2026-12-04). phalanx puts the generator and the stream back.
    tried, lines = _dropout_steps(capture=True)
    assert len(lines) == 1 and lines[0].startswith("CUDA graph step abandoned, running eagerly: capturing the step")
    assert torch.cuda.current_stream(CUDA) == torch.cuda.default_stream(CUDA)
    assert F.dropout(torch.ones(64, device=CUDA), 0.5).shape == (64,)  # raised before the fix
    never, _ = _dropout_steps(capture=False)
    # the same masks: a mask of its own would move a loss by ~1e-2, the streams' kernels by ~1e-7 at most
    torch.testing.assert_close(tried, never, rtol=1e-5, atol=0)


@pytest.mark.parametrize("extra", [["--model", "lenet-bn"], ["--optimizer", "adam"], ["--momentum", "0.9"]])
def test_batchnorm_adam_and_momentum_are_captured(tmp_path, idx_dir, capsys, extra):
    code = main(["train", "--devices", "cuda:0", "--data-dir", str(idx_dir), "--epochs", "1", "--no-progress",
                 "--cuda-graphs", "on", *extra])
    out = capsys.readouterr().out
    assert code == 0 and "step captured as one CUDA graph" in out.splitlines()[0] and "abandoned" not in out


@pytest.mark.parametrize("extra, words", [
    (["--grad-accum", "2"], "eager step (--grad-accum 2 runs micro-batches"),
    (["--warmup-epochs", "0.5"], "eager step (lr warmup changes the lr every step"),
    (["--cuda-graphs", "off"], "eager step (--cuda-graphs off)"),
])
def test_refusals_are_named_in_the_first_line(tmp_path, idx_dir, capsys, extra, words):
    code = main(["train", "--devices", "cuda:0", "--data-dir", str(idx_dir), "--epochs", "1", "--no-progress",
                 *extra])
    assert code == 0 and words in capsys.readouterr().out.splitlines()[0]


# phalanx's eager step and the plain loop's run in the tests above and below; these are bench gpu's own.
@pytest.mark.parametrize("kind, graphs", [("phalanx", True), ("plain", True), ("ddp", False)])
def test_bench_gpu_contenders_run(kind, graphs):
    record = run_one_device(OneDeviceJob(kind=kind, device="cuda", num_images=2048, global_batch_size=256,
                                         warmup_epochs=1, epochs=1, graphs=graphs), deadline_s=120)
    assert record["images"] == [2048] and record["wall_s"][0] > 0
    # bench gpu reads these of every contender (a KeyError on the plain loop's, on the first H200 it met)
    assert record["graph"] == ("replaying" if graphs else None) and record["notes"] == []


def test_the_api_pages_captured_step_replays_on_one_gpu(tmp_path):
    (code,) = [code for _, code in python_blocks(API_DOC.read_text()) if "capture_step" in code]
    script = tmp_path / "captured.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines() == ["captured step trained (replaying)"]
