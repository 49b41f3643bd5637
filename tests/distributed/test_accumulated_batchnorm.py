"""Gradient accumulation with synchronized BatchNorm: k devices equal 1 device, statistics included.

A BatchNorm model trained in micro-batches normalizes each micro-batch by its own statistics, so
which examples form micro-batch j is part of the result. One device cuts the global batch into
contiguous micro-batches; `phalanx train` hands each of k ranks every k-th row
(`accumulation_rows`), so micro-batch j over all ranks holds exactly those examples. Before
2026-12-07 each rank cut its own contiguous shard instead, and LeNet-BN's running variance after
2 epochs of `--grad-accum 2` on 3 workers differed from 1 device's by 58% (found by
tools/combo_fuzz.py). Real runs through the launcher, float64, an uneven last batch.
"""

from dataclasses import replace

import pytest
import torch

from phalanx.data.config import DataConfig
from phalanx.data_parallel.config import DataParallelConfig
from phalanx.job.config import TrainConfig
from phalanx.job.job import train_worker
from phalanx.job.optim import OptimizerConfig
from phalanx.runtime.devices import parse_devices
from phalanx.runtime.launch import LaunchSpec, launch

pytestmark = pytest.mark.distributed

BASE = TrainConfig(model="lenet-bn", data=DataConfig(dataset="synthetic", train_examples=145), epochs=2,
                   global_batch_size=29, optim=OptimizerConfig(lr=0.05), seed=1, progress=False, dtype="float64")


def _train(tmp_path, devices: str, grad_accum: int, allreduce: str = "auto"):
    plan = parse_devices(devices, cuda_count=0)
    out = tmp_path / f"{devices}-{grad_accum}-{allreduce}"
    config = replace(BASE, out_dir=str(out),
                     data_parallel=DataParallelConfig(grad_accum_steps=grad_accum, allreduce=allreduce))
    results = launch(train_worker, config, plan.names, spec=LaunchSpec(plan=plan, threads_per_device=1, timeout_s=60))
    return torch.load(out / "model.pt", weights_only=True), results[0]["history"]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return {accum: _train(tmp_path_factory.mktemp("one"), "1", accum) for accum in (2, 3)}


@pytest.mark.parametrize("devices, grad_accum, allreduce", [("2", 2, "auto"), ("3", 2, "ring"), ("2", 3, "native")])
def test_micro_batches_over_k_devices_are_one_devices(tmp_path, one_device, devices, grad_accum, allreduce):
    reference, ref_history = one_device[grad_accum]
    state, history = _train(tmp_path, devices, grad_accum, allreduce)
    assert list(state) == list(reference)
    for name, ref in reference.items():  # parameters, running means and variances
        if ref.is_floating_point():
            torch.testing.assert_close(state[name], ref, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")
        else:
            assert torch.equal(state[name], ref), name
    for row, ref_row in zip(history, ref_history, strict=True):
        assert row["train_loss"] == pytest.approx(ref_row["train_loss"], rel=1e-12)
        assert row["test_acc"] == ref_row["test_acc"]  # each rank counted every k-th test image, all counted once
