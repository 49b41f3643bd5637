"""The python fragments of docs/sharding.md run as written, in a world of one, with the names they
assume around them (a world, a model, a loader, an epoch): a fragment that unpacks
`loader.epoch(e)` wrongly or names something that does not exist fails here. docs/api.md's
blocks run under `phalanx run` in tests/distributed/test_api_doc.py; sharding.md's last block
reads a sharded checkpoint of 2 ranks, which a world of one cannot write (it was run by hand
against `phalanx train --devices cpu:2 --shard parameters --checkpoint-every epoch`: model.pt's
values, bitwise)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel

import phalanx

PAGE = Path(__file__).resolve().parents[2] / "docs" / "sharding.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), re.S | re.M)


@pytest.mark.parametrize("index", [0, 1])
def test_a_sharding_fragment_trains_an_epoch(index):
    world = phalanx.init()
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(20, 4), torch.randint(0, 3, (20,)))
    loader = phalanx.ShardedLoader(data, world=world, global_batch_size=8, seed=0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    before = [p.detach().clone() for p in model.parameters()]
    code = BLOCKS[index].replace("...; ", "")  # the fragment's elided step: its optimizer.step() stays
    names = dict(torch=torch, F=F, nn=nn, phalanx=phalanx, AveragedModel=AveragedModel, world=world,
                 model=model, loader=loader, epoch=0)
    if "phalanx.prepare(" not in code:  # a fragment that prepares the model does it once, itself
        names["dp"] = phalanx.prepare(model, world=world, shard="gradients")
        names["optimizer"] = names["dp"].optimizer(torch.optim.SGD, lr=0.1)
    exec(compile(code, f"{PAGE.name} block {index}", "exec"), names)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))  # a step, or the clamp
    names["dp"].close()


def test_the_page_still_has_the_fragments_this_runs():
    assert len(BLOCKS) == 3 and "loader.epoch(epoch)" in BLOCKS[0] and "gathered_parameters" in BLOCKS[1]
