"""A stream (an IterableDataset) that yields fewer items on one rank than on another stops every
rank in one line, before a step trains on a batch that differs, on 2 gloo workers.

Every rank reads the whole stream and keeps its slice of each global batch, so the ranks must
read as many items. Where rank 1's stream was one item short, two things went wrong: with 16
items against 15 (global batch 8) both ranks trained a last batch, of 8 on rank 0 and 7 on rank
1, each dividing its loss by its own global size and one item trained by no rank, silently (only
a later evaluate_dataset's count noticed); with 17 against 16 rank 0 trained a third batch alone
and the run stopped on "ranks are in different collectives ... under `if world.is_main:`", a
cause the script did not have. Now every global batch's size, and whether it ends the stream, is
compared on every rank first (one allreduce of 2 x k numbers a batch)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

BATCH = 8


class _Stream(torch.utils.data.IterableDataset):
    """`sizes[rank]` items of (features, label) on each rank; the same items wherever they exist."""

    def __init__(self, sizes: tuple[int, ...], rank: int) -> None:
        self.count = sizes[rank]
        g = torch.Generator().manual_seed(3)
        most = max(sizes)
        self.x = torch.randn(most, 3, generator=g, dtype=torch.float64)
        self.y = torch.randint(0, 3, (most,), generator=g)

    def __iter__(self):
        for i in range(self.count):
            yield self.x[i], self.y[i]


def _train(world, sizes: tuple[int, ...]):
    """Train one epoch on the stream; the steps done, or the error's line."""
    torch.manual_seed(0)
    dp = phalanx.prepare(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double(), world=world)
    optimizer = torch.optim.SGD(dp.parameters(), lr=0.1)
    loader = phalanx.ShardedLoader(_Stream(sizes, world.rank), world=world, global_batch_size=BATCH, seed=0)
    steps = 0
    try:
        for (x, y), global_size in loader.epoch(0):
            optimizer.zero_grad()
            phalanx.shard_loss(F.cross_entropy(dp(x), y, reduction="sum"), global_size).backward()
            dp.finish_gradient_sync()
            optimizer.step()
            steps += 1
    except phalanx.UsageError as exc:
        return steps, str(exc)
    finally:
        dp.close()
    return steps, None


CASES = {(16, 15): (1, "rank 0's holds 8 item(s) and ends its stream, rank 1's holds 7 item(s) and ends its stream"),
         (17, 16): (1, "rank 0's holds 8 item(s), more follow, rank 1's holds 8 item(s) and ends its stream"),
         (5, 0): (0, "rank 0's holds 5 item(s) and ends its stream, rank 1's holds 0 item(s) and ends its stream"),
         (17, 17): (3, None)}


def _cases(world):
    return {sizes: _train(world, sizes) for sizes in CASES}


def test_a_stream_shorter_on_one_rank_stops_every_rank_before_the_batch_that_differs():
    results = run_workers(_cases, 2, timeout_s=180)
    for sizes, (batch, differs) in CASES.items():
        for steps, said in (results[0][sizes], results[1][sizes]):
            assert steps == batch, (sizes, steps, said)
            if differs is None:
                assert said is None, said
                continue
            assert said is not None and said.startswith(
                f"the stream's global batch {batch} of epoch 0 differs between ranks ({differs}): every rank must read "
                "the same items"), said
            assert "\n" not in said
        assert results[0][sizes] == results[1][sizes]
