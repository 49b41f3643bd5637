"""The training job runs a global batch larger than the training set (one step per epoch) but
says so in one line on rank 0 (issue 21: `--batch-size 60000` on 3,000 images was accepted
without a note); a batch that fits gets no such line."""

import torch

from phalanx.data.config import DataConfig
from phalanx.job.config import TrainConfig
from phalanx.job.job import train_worker
from phalanx.runtime.world import World

WORLD1 = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
               backend="none", timeout_s=60)


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
