"""--split layers and --split channels compute the 1-device update, and keep the job's contract.

Real runs through the real launcher and job on k spawned gloo workers, float64, 2 epochs of a
small generated dataset (uneven last batch): the final parameters of every split at k = 2 and
k = 4 (1F1B for one pipeline) must equal the 1-device run's to 1e-9 relative per tensor; without
the reduce-scatter in channels' backward, or with a micro-batch's loss scaled by its own size,
they would differ at the first step. model.pt is one ordinary LeNet state dict. A run stopped
after epoch 1 and resumed from its checkpoint ends where an uninterrupted run does.
"""

from dataclasses import replace

import pytest
import torch

from phalanx.runtime.devices import parse_devices
from phalanx.runtime.launch import LaunchSpec, launch
from phalanx.models import LeNet
from phalanx.telemetry.metrics import read_metrics
from phalanx.data.config import DataConfig
from phalanx.job.checkpointing import CheckpointConfig
from phalanx.job.optim import OptimizerConfig
from phalanx.model_split.config import SplitConfig
from phalanx.job.config import TrainConfig
from phalanx.job.job import train_worker
from tests.distributed.split_data import write_small_fashion_mnist

pytestmark = pytest.mark.distributed


def _train(out, config, devices: int):
    plan = parse_devices(f"cpu:{devices}", cuda_count=0)
    config = replace(config, out_dir=str(out))
    launch(train_worker, config, plan.names, spec=LaunchSpec(plan=plan, threads_per_device=1, timeout_s=60,
                                                             deadline_s=300))
    return torch.load(out / "model.pt", weights_only=True)


def _max_relative(state, reference) -> float:
    return max(((state[n] - reference[n]).abs().max() / reference[n].abs().max()).item() for n in reference)


@pytest.fixture(scope="module")
def base_config(tmp_path_factory):
    data_dir = write_small_fashion_mnist(tmp_path_factory.mktemp("data"))
    return TrainConfig(data=DataConfig(dataset="fashion-mnist", directory=str(data_dir)), epochs=2, global_batch_size=128,
                       optim=OptimizerConfig(lr=0.2),
                       seed=5, progress=False, dtype="float64")


@pytest.fixture(scope="module")
def one_device(tmp_path_factory, base_config):
    return _train(tmp_path_factory.mktemp("one"), base_config, 1)


@pytest.mark.parametrize("split, devices, schedule, micro_batches", [
    ("layers", 2, "gpipe", None), ("layers", 4, "1f1b", 5), ("channels", 2, "gpipe", None),
    ("channels", 4, "gpipe", None)])
def test_split_equals_one_device(tmp_path, base_config, one_device, split, devices, schedule, micro_batches):
    config = replace(base_config, split=SplitConfig(kind=split, schedule=schedule, micro_batches=micro_batches))
    state = _train(tmp_path / "run", config, devices)
    assert list(state) == list(one_device)  # one ordinary LeNet state dict, in LeNet's order
    LeNet().double().load_state_dict(state)  # loads like any LeNet
    assert _max_relative(state, one_device) < 1e-9
    torch.manual_seed(base_config.seed)
    initial = LeNet().double().state_dict()
    assert _max_relative(state, initial) > 1e-3  # training moved the parameters: the check is not vacuous
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [1, 2] and rows[-1]["split"] == split
    assert rows[-1]["devices"] == [f"cpu:{i}" for i in range(devices)]
    assert (tmp_path / "run" / "accuracy.png").exists()


def test_a_resumed_split_run_ends_where_an_uninterrupted_one_does(tmp_path, base_config, one_device):
    config = replace(base_config, split=SplitConfig(kind="layers"), checkpoint=CheckpointConfig(every="3"), epochs=1,
                     out_dir=str(tmp_path / "run"))
    _train(tmp_path / "run", config, 2)  # stops after epoch 1 (checkpoints at step 3 and the epoch end)
    resumed = _train(tmp_path / "run", replace(config, epochs=2, checkpoint=CheckpointConfig(every="3", resume="auto"),
                                                         split=SplitConfig(kind="channels")), 2)
    # Resumed under another split, even: every split computes the same update from the same state.
    assert _max_relative(resumed, one_device) < 1e-9
    assert [r["epoch"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
