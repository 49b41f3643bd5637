"""ShardedLoader with DataLoader worker processes (started here, so in this tier): with
`persistent_workers=True` one set of workers serves every epoch, as DDP users get from a
DataLoader over a DistributedSampler with set_epoch (ShardedLoader built a DataLoader per epoch,
so its workers were started again each epoch); without it each epoch starts its own; the
batches are one device's either way."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import Dataset

import phalanx

pytestmark = pytest.mark.distributed


class _WhoReads(Dataset):
    """Example i is (i, the pid of the process that read it)."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int):
        return torch.tensor(float(i)), os.getpid()


@pytest.mark.parametrize("persistent", [True, False])
def test_persistent_loader_workers_serve_every_epoch(persistent):
    data = _WhoReads()
    ranks = 2
    loaders = [phalanx.ShardedLoader(data, world=SimpleNamespace(rank=r, world_size=ranks), global_batch_size=8,
                                     seed=1, num_workers=2, persistent_workers=persistent) for r in range(ranks)]
    one = phalanx.ShardedLoader(data, world=SimpleNamespace(rank=0, world_size=1), global_batch_size=8, seed=1)
    readers = []
    for epoch in range(3):
        pids = set()
        for step, pieces in enumerate(zip(*(loader.epoch(epoch) for loader in loaders))):
            (x_one, _), _ = list(one.epoch(epoch))[step]
            assert torch.equal(torch.cat([x for (x, _), _ in pieces]), x_one)  # one device's batch, split
            pids |= {int(p) for (_, who), _ in pieces for p in who}
        assert os.getpid() not in pids and len(pids) == 2 * ranks  # two workers per rank read everything
        readers.append(pids)
    assert (readers[0] == readers[1] == readers[2]) == persistent, readers
