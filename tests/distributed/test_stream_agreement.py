"""A stream that yields other items on each rank is named, on 2 gloo workers: `phalanx.ShardedLoader`
compares the identities (labels, keys) of every epoch's first global batch across ranks, and rank
0 warns once, at the user's loop, naming the rank and the fix (seed the shuffle). A seeded stream
is quiet, also when each rank augments its items' floating values with its own random numbers;
so is a stream that differs only in floating values (nothing identifies its items)."""

from __future__ import annotations

import warnings

import pytest
import torch

import phalanx
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

N, BATCH, EPOCHS = 40, 8, 3


class _Shuffled(torch.utils.data.IterableDataset):
    """Items 0..N-1 in an order drawn from `seed` and the epoch; `noise` (a rank's own seed) adds
    random noise to the floating part, as a per-rank augmentation would; `keyed`: dict items."""

    def __init__(self, seed: int, *, noise: int | None = None, keyed: bool = False, labels: bool = True) -> None:
        self.seed, self.noise, self.keyed, self.labels, self.epoch = seed, noise, keyed, labels, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(N, generator=torch.Generator().manual_seed(self.seed * 100 + self.epoch))
        jitter = torch.Generator().manual_seed(self.noise) if self.noise is not None else None
        for i in order.tolist():
            x = torch.full((3,), float(i), dtype=torch.float64)
            if jitter is not None:
                x += torch.randn(3, generator=jitter, dtype=torch.float64)
            if self.keyed:
                yield {"__key__": f"sample-{i:05d}", "x": x}
            else:
                yield (x, i) if self.labels else x


def _said(world, stream: _Shuffled) -> list[tuple[str, str]]:
    loader = phalanx.ShardedLoader(stream, world=world, global_batch_size=BATCH)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(EPOCHS):
            for _batch, _size in loader.epoch(epoch):
                pass
    return [(str(w.message), w.filename) for w in caught if issubclass(w.category, phalanx.PhalanxWarning)]


def _worker(world) -> dict:
    rank = world.rank
    return {
        "unseeded": _said(world, _Shuffled(seed=1000 + rank)),
        "unseeded, keyed": _said(world, _Shuffled(seed=1000 + rank, keyed=True)),
        "seeded, augmented per rank": _said(world, _Shuffled(seed=7, noise=rank)),
        "seeded, keyed, augmented": _said(world, _Shuffled(seed=7, noise=rank, keyed=True)),
        "floats only, unseeded": _said(world, _Shuffled(seed=1000 + rank, labels=False)),
    }


def test_a_stream_that_differs_between_ranks_is_named_once_by_rank_0():
    results = run_workers(_worker, 2, timeout_s=90)
    assert all(not said for said in results[1].values())  # rank 1 says nothing
    for case in ("unseeded", "unseeded, keyed"):
        said = results[0][case]
        assert len(said) == 1, (case, said)  # once, not every epoch
        message, filename = said[0]
        assert message.startswith("the stream's first global batch of epoch 0 holds other items than rank 0's on "
                                  "rank 1 (its keys, labels or token ids differ): every rank must read the same "
                                  "items in the same order"), message
        assert "seed the stream's shuffle (e.g. dataset.shuffle(seed=42, buffer_size=...))" in message
        assert "\n" not in message and filename == __file__  # points at the loop that read the loader
    for case in ("seeded, augmented per rank", "seeded, keyed, augmented", "floats only, unseeded"):
        assert results[0][case] == [], (case, results[0][case])
