"""A world made in another process (a notebook's `world = phalanx.init()` that a function forked by
`phalanx.launch` captured) is refused by every front-door call that takes `world=`, not only by
prepare, the replica and ShardedLoader (docs/api.md promises any use). With it each worker
is a world of one: a reduce returned the worker's own value, a gather its own rows, a barrier
waited for nobody, and main_first ran the block on every worker at once, all silently.
tests/distributed/test_function_launch.py runs the real fork."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import phalanx
from phalanx.runtime.world import World

HERE = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), backend="none",
             timeout_s=10.0)
ELSEWHERE = dataclasses.replace(HERE, pid=os.getpid() + 1)  # what a forked worker holds of its parent's world


def _main_first(world):
    with phalanx.main_first(world=world):
        pass


DATA = TensorDataset(torch.randn(4, 3), torch.tensor([0, 1, 0, 1]))
CALLS = {
    "phalanx.reduce": lambda world: phalanx.reduce(1.0, op="sum", world=world),
    "phalanx.allreduce": lambda world: phalanx.allreduce(torch.ones(2), world=world),
    "phalanx.gather": lambda world: phalanx.gather(torch.ones(2), world=world),
    "phalanx.barrier": lambda world: phalanx.barrier(world=world),
    "phalanx.broadcast": lambda world: phalanx.broadcast("run-7", world=world),
    "phalanx.main_first": _main_first,
    "phalanx.evaluate_dataset": lambda world: phalanx.evaluate_dataset(nn.Linear(3, 2), DATA, world=world),
    "phalanx.evaluate": lambda world: phalanx.evaluate(nn.Linear(3, 2), torch.zeros(4, 3, dtype=torch.uint8),
                                                       DATA.tensors[1], world=world),
}


@pytest.mark.parametrize("name", CALLS)
def test_a_world_of_another_process_is_refused_naming_the_call(name):
    CALLS[name](HERE)  # this process's own world: works
    with pytest.raises(phalanx.UsageError, match=rf"^{name} uses a world made in another process .* call "
                                                 r"phalanx.init\(\) inside the function"):
        CALLS[name](ELSEWHERE)


def test_checkpoint_and_resume_refuse_it_before_writing_or_reading(tmp_path):
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    common = dict(model=model, optimizer=optimizer, global_batch_size=4, seed=0)
    with pytest.raises(phalanx.UsageError, match="^phalanx.checkpoint uses a world made in another process"):
        phalanx.checkpoint(tmp_path, world=ELSEWHERE, epoch=0, **common)
    assert list(tmp_path.iterdir()) == []
    phalanx.checkpoint(tmp_path, world=HERE, epoch=0, **common)
    with pytest.raises(phalanx.UsageError, match="^phalanx.resume uses a world made in another process"):
        phalanx.resume(tmp_path, world=ELSEWHERE, **common)
