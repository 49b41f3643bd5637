"""A user's loop accumulating a BatchNorm model's gradients over `ShardedLoader(micro_batches=n)`:
k ranks equal torch alone on one device accumulating the same contiguous micro-batches, running
statistics included.

One device cuts each global batch into n contiguous micro-batches and normalizes each by its own
statistics. A rank that cuts its own contiguous shard into n pieces (`split_batch(*shard, n)`, as
DDP users do) has a synchronized BatchNorm normalize every rank's j-th piece together: other
examples than one device's micro-batch j, so the result differs (checked here, so the test can
fail). `micro_batches=n` collates rows r, r+k, ... of the global batch as the n pieces, so piece j
over the ranks is one device's micro-batch j. Float64, AdamW, a global batch of 13 over 2 and 3
ranks (an uneven cut and a smaller last batch), map-style and a stream.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

import phalanx
from phalanx.data import split_batch
from phalanx.data.split import global_batches, shard_sizes
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

EXAMPLES, GLOBAL_BATCH, EPOCHS, SEED = 44, 13, 2, 5


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    X = torch.randn(EXAMPLES, 2, 6, 6, generator=g, dtype=torch.float64)
    return X, torch.randint(0, 3, (EXAMPLES,), generator=g)


class _Stream(IterableDataset):
    """The same examples, in index order, as a stream every rank reads whole."""

    def __iter__(self):
        X, y = _data()
        yield from zip(X, y)


def _model() -> nn.Module:
    """No bias before BatchNorm: its gradient is 0 in exact arithmetic, and AdamW divides its
    rounding by its own ~0 scale (with a bias there, 2 ranks were 1.1e-9 from one device)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(64, 3)).double()


def _loss_sum(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(X), y, reduction="sum")


def _one_device(micro_batches: int, stream: bool) -> dict:
    """torch alone: each global batch (ShardedLoader's order, or the stream's) in n contiguous micro-batches."""
    X, y = _data()
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    for epoch in range(EPOCHS):
        order = (list(torch.arange(EXAMPLES).split(GLOBAL_BATCH)) if stream else
                 global_batches(EXAMPLES, GLOBAL_BATCH, seed=SEED, epoch=epoch))
        for rows in order:
            optimizer.zero_grad()
            for piece in rows.split(shard_sizes(len(rows), min(micro_batches, len(rows)))):
                (_loss_sum(model, X[piece], y[piece]) / len(rows)).backward()
            optimizer.step()
    return model.state_dict()


def _worker(world, micro_batches: int, way: str) -> dict:
    data = _Stream() if way == "stream" else TensorDataset(*_data())
    dp = phalanx.prepare(_model(), world=world)  # BatchNorm synchronized (batchnorm="sync")
    optimizer = torch.optim.AdamW(dp.parameters(), lr=0.05)
    cut = None if way == "own-shard" else micro_batches  # None: the plain batch, cut by the rank itself
    loader = phalanx.ShardedLoader(data, world=world, global_batch_size=GLOBAL_BATCH, seed=SEED, micro_batches=cut)
    for epoch in range(EPOCHS):
        for batch, global_size in loader.epoch(epoch):
            pieces = split_batch(*batch, micro_batches) if way == "own-shard" else batch
            dp.zero_grad()
            for X, y in dp.accumulate(pieces):
                phalanx.shard_loss(_loss_sum(dp, X, y), global_size).backward()
            dp.finish_gradient_sync()
            optimizer.step()
    state = {k: v.detach().clone() for k, v in dp.module.state_dict().items()}
    dp.close()
    return state


def _worst(state: dict, want: dict) -> float:
    return max(((state[k] - w).abs().max() / w.abs().max()).item() for k, w in want.items() if w.is_floating_point())


@pytest.mark.parametrize("ranks, micro_batches, way", [(2, 2, "map"), (3, 3, "map"), (3, 2, "stream")])
def test_micro_batches_of_k_ranks_are_one_devices_micro_batches(ranks, micro_batches, way):
    want = _one_device(micro_batches, stream=way == "stream")
    states = run_workers(_worker, ranks, micro_batches, way, timeout_s=120)
    assert _worst(states[0], want) <= 1e-12, _worst(states[0], want)  # running mean and variance too
    assert all(torch.equal(states[r][k], states[0][k]) for r in range(1, ranks) for k in want)
    assert states[0]["1.num_batches_tracked"] == want["1.num_batches_tracked"]


def test_a_rank_cutting_its_own_shard_into_pieces_normalizes_other_examples():
    want = _one_device(2, stream=False)
    states = run_workers(_worker, 2, 2, "own-shard", timeout_s=120)
    assert _worst(states[0], want) > 1e-2  # every rank's j-th piece together is not one device's micro-batch j
