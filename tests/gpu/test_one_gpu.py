"""One GPU, one process: an epoch never synchronises the host with the GPU, and the
BatchNorm model trains. Skipped where no GPU is present; tests/unit/test_world_of_one.py checks
on the CPU what can be checked there (no host read of a tensor inside an epoch)."""

import pytest
import torch

from phalanx.cli import main
from phalanx.models import build_model
from phalanx.data_parallel import DataParallel
from phalanx.telemetry.metrics import read_metrics
from phalanx.data_parallel.strategy import DataSplit
from phalanx.train.loop import train_epoch
from phalanx.runtime.world import World

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("model_name", ["lenet", "lenet-bn"])
@pytest.mark.parametrize("grad_accum_steps", [1, 2])
def test_an_epoch_runs_under_sync_debug_mode_error(model_name, grad_accum_steps):
    """Any .item(), pageable host-to-device copy or other synchronising call inside the epoch
    raises here; the mode is switched off in the last step's callback, before the epoch's totals
    are read (once, by design)."""
    device = torch.device("cuda", 0)
    world = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=device, backend="none",
                  timeout_s=30.0)
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (1000, 1, 28, 28), dtype=torch.uint8, generator=gen).to(device)
    labels = torch.randint(0, 10, (1000,), generator=gen).to(device)
    torch.manual_seed(0)
    with DataParallel(build_model(model_name).to(device), world=world) as dp:
        optimizer = torch.optim.SGD(dp.module.parameters(), lr=0.1)
        steps = []

        def on_step(done: int, total: int) -> None:
            steps.append(done)
            if done == total:
                torch.cuda.set_sync_debug_mode("default")

        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            stats = train_epoch(DataSplit(dp, grad_accum_steps=grad_accum_steps), optimizer, images, labels,
                                world=world, global_batch_size=256, seed=0, epoch=0, on_step=on_step)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert steps == [1, 2, 3, 4] and stats.num_examples == 1000  # 3 x 256 + 232: an uneven last batch
    assert 0 < stats.train_loss < 10


def test_lenet_bn_trains_on_one_gpu(tmp_path, idx_dir, capsys):
    out = tmp_path / "bn"
    code = main(["train", "--devices", "cuda:0", "--model", "lenet-bn", "--data-dir", str(idx_dir),
                 "--epochs", "2", "--no-progress", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [1, 2]
    # On this machine's CPU (same seed and data): loss 1.11 -> 0.65, train acc 0.76, test acc 0.45
    # (the running statistics lag behind in epoch 2); chance is 0.1.
    assert rows[-1]["train_loss"] < rows[0]["train_loss"] and rows[-1]["train_acc"] > 0.6
    assert rows[-1]["test_acc"] > 0.2
    state = torch.load(out / "model.pt", weights_only=True)
    assert state["bn3.running_var"].device.type == "cpu" and state["bn3.num_batches_tracked"] == 2 * 12


def test_devices_cpu_auto_probes_cpu_workers_where_a_gpu_is(tmp_path):
    # --devices auto takes the GPU here; cpu:auto asks for the CPU probe (the 16-core host beside the
    # H200 could not say what auto chose for CPU workers without it).
    import os
    import re
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "phalanx", "train", "--devices", "cpu:auto", "--dataset", "synthetic",
                           "--epochs", "1", "--no-progress", "--timeout", "60", "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = proc.stdout.splitlines()[:2]
    found = re.match(r"--devices auto: cpu:(\d+) x (\d+) threads? \(measured images/s", first)
    assert found, first
    assert f"on [{', '.join(f'cpu:{i}' for i in range(int(found.group(1))))}]" in second, second
