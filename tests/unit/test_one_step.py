"""One step: `phalanx train`'s epochs and `train_batch` - what verify, bench and predict
measure - run the same step function, `train_step`, once per optimizer step; and a step through
`train_batch` equals the epoch's step on the same rows, bitwise."""

from __future__ import annotations

import torch

from phalanx.data import global_batches, to_float
from phalanx.data_parallel import DataParallel
from phalanx.data_parallel.strategy import DataSplit
from phalanx.models import LeNet
from phalanx.runtime.world import World
from phalanx.train import loop

WORLD1 = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), backend="none",
               timeout_s=10)


def _counting(monkeypatch) -> list:
    calls = []
    real = loop.train_step

    def counted(strategy, optimizer, X, y, **kw):
        calls.append((type(strategy).__name__, X.shape[0], kw["global_batch_size"]))
        return real(strategy, optimizer, X, y, **kw)
    monkeypatch.setattr(loop, "train_step", counted)
    return calls


def _data(n: int = 37):
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n, 1, 28, 28), dtype=torch.uint8, generator=gen), torch.randint(0, 10, (n,), generator=gen)


def test_train_epoch_and_train_batch_run_the_one_step_function(monkeypatch):
    calls = _counting(monkeypatch)
    images, labels = _data()
    torch.manual_seed(0)
    with DataParallel(LeNet().double(), world=WORLD1) as dp:
        optimizer = torch.optim.SGD(dp.module.parameters(), lr=0.1)
        loop.train_epoch(DataSplit(dp), optimizer, images, labels, world=WORLD1, global_batch_size=16, seed=0, epoch=0)
        assert calls == [("DataSplit", 16, 16), ("DataSplit", 16, 16), ("DataSplit", 5, 5)]
        X = images[:8].double() / 255
        loop.train_batch(dp, optimizer, X, labels[:8], global_batch_size=8)
    assert calls[-1] == ("DataSplit", 8, 8) and len(calls) == 4


def test_a_step_of_the_epoch_equals_train_batch_on_the_same_rows():
    images, labels = _data(16)
    params = []
    for through_epoch in (True, False):
        torch.manual_seed(0)
        with DataParallel(LeNet().double(), world=WORLD1) as dp:
            optimizer = torch.optim.SGD(dp.module.parameters(), lr=0.1)
            if through_epoch:
                loop.train_epoch(DataSplit(dp), optimizer, images, labels, world=WORLD1, global_batch_size=16, seed=0,
                                 epoch=0)
            else:
                (batch,) = global_batches(16, 16, seed=0, epoch=0)
                loop.train_batch(dp, optimizer, to_float(images[batch], torch.float64), labels[batch], global_batch_size=16)
            params.append([p.detach().clone() for p in dp.module.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*params))
