"""Whole training jobs on one device, in this process (the job's `train_worker`, or `phalanx train`
through `main`): what only a run shows, where tests/unit checks the parts. The --momentum the job
builds changes its losses; a global batch larger than the training set (one step per epoch)
still trains and says so in one line on rank 0 (a batch that fits gets no such line); a first
run offline says one line about the missing download and the second tries no more (the network
simulated, as in tests/unit/test_data_offline.py); LeNet learns the real Fashion-MNIST sample."""

from __future__ import annotations

import torch

from phalanx.cli import main
from phalanx.data import fashion_mnist
from phalanx.data.config import DataConfig
from phalanx.job.config import TrainConfig
from phalanx.job.job import train_worker
from phalanx.job.optim import OptimizerConfig
from phalanx.runtime.world import World
from tests.unit.test_data_offline import DIGITS, FALLBACK, Offline

WORLD1 = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
               backend="none", timeout_s=60)


def test_the_job_trains_with_momentum():
    def history(momentum: float) -> list[float]:
        config = TrainConfig(data=DataConfig(dataset="digits"), epochs=1, global_batch_size=128, progress=False,
                             optim=OptimizerConfig(lr=0.05, momentum=momentum))
        return [row["train_loss"] for row in train_worker(WORLD1, config, ["cpu:0"])["history"]]

    assert history(0.9) != history(0.0)


def _notes(capsys, global_batch_size: int) -> tuple[list[str], dict]:
    config = TrainConfig(model="lenet", data=DataConfig(dataset="digits"), epochs=1, global_batch_size=global_batch_size,
                         progress=False)
    result = train_worker(WORLD1, config, ["cpu:0"])
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")], result


def test_a_global_batch_larger_than_the_training_set_gets_a_one_line_note(capsys):
    notes, result = _notes(capsys, 2000)
    assert notes == ["note: --batch-size 2000 is larger than the 1437 training images, so every step trains on all "
                     "of them (one step per epoch); use --batch-size 1437 or less"]
    assert len(result["history"]) == 1  # still trained: the note is not a refusal
    assert _notes(capsys, 1437)[0] == []


def test_the_command_offline_prints_one_line_then_tries_no_more(tmp_path, monkeypatch, capsys):
    # Not two "downloading http://..." lines and a ~330-character line on every run, nor an empty cache.
    offline = Offline()
    monkeypatch.setattr(fashion_mnist, "fetch_url", offline)
    monkeypatch.setenv("PHALANX_DATA_DIR", str(tmp_path / "cache"))
    argv = ["train", "--devices", "1", "--epochs", "1", "--no-progress"]
    assert main(argv) == 0
    first = capsys.readouterr()
    about = [line for line in (first.out + first.err).splitlines() if "download" in line or "fashion" in line]
    assert len(about) == 1 and about[0].startswith(FALLBACK), first
    assert first.out.splitlines()[-1].startswith("test acc (digits): ")  # the fallback's accuracy, named
    assert len(offline.urls) == 2
    assert main(argv) == 0
    second = capsys.readouterr()
    assert len(offline.urls) == 2, "the second run tried the download again"
    assert [line for line in second.out.splitlines() if line.startswith(FALLBACK)][0].endswith(DIGITS)


def test_lenet_learns_the_real_sample(real_sample_dir):
    """4 epochs of batch 128 on the real 3,000/1,000 sample, one process: over 55% test accuracy."""
    config = TrainConfig(data=DataConfig(dataset="fashion-mnist", directory=str(real_sample_dir)), epochs=4,
                         global_batch_size=128, progress=False)
    result = train_worker(WORLD1, config, ["cpu:0"])
    assert result["history"][-1]["test_acc"] > 0.55, result["history"]
