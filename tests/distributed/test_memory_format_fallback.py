"""`memory_format="auto"`'s fallback to contiguous on 2 gloo workers (format_fallback.py).

The tutorial CNN that `.view()`s a conv output (tests/unit/test_memory_format_fallback.py) trains
on 2 workers, float64, SyncBatchNorm, as plain torch does on the whole batch: every rank met the
view error at its first forward and fell back alike. A rank whose first shard is empty views
nothing and keeps channels_last; the first synced step's count refuses that on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import phalanx
from tests.distributed.harness import WorkersFailed, run_workers
from tests.unit.test_memory_format_fallback import TutorialNet, max_difference, plain_torch, train

pytestmark = pytest.mark.distributed


class ViewsBySize(TutorialNet):
    """The tutorial's own `x.view(-1, 16 * 5 * 5)`: an empty batch views too (unlike `view(x.size(0), -1)`)."""

    def forward(self, x):
        x = self.pool(F.relu(self.conv2(self.pool(F.relu(self.conv1(x))))))
        return self.fc(x.view(-1, 6 * 2 * 2))


def _uneven_first_step(world) -> None:
    torch.manual_seed(0)
    dp = phalanx.prepare(ViewsBySize(0.0, batchnorm=False), world=world, dtype="float64")
    optimizer = torch.optim.SGD(dp.parameters(), lr=0.1)
    x, y = torch.randn(1, 3, 16, 16, dtype=torch.float64), torch.tensor([1])
    mine = phalanx.rank_shard(torch.arange(1), rank=world.rank, world_size=world.world_size)  # rank 1: empty
    phalanx.shard_loss(F.cross_entropy(dp(x[mine]), y[mine], reduction="sum"), 1).backward()
    dp.finish_gradient_sync()
    optimizer.step()


def test_two_workers_fall_back_alike_and_train_as_plain_torch():
    results = run_workers(train, 2, "auto", 0.0, timeout_s=120)  # per-rank dropout masks differ from one device's
    want = plain_torch(0.0)
    for result in results:
        assert ", contiguous (the model's forward .view()s a conv output), float64" in result["describe"]
        assert max_difference(result["state"], want) < 1e-12
    assert max_difference(results[0]["state"], results[1]["state"]) == 0.0


def test_ranks_that_chose_differently_are_refused_at_the_first_step():
    with pytest.raises(WorkersFailed) as caught:
        run_workers(_uneven_first_step, 2, timeout_s=120)
    assert "1 of 2 ranks laid the model out contiguous at their first forward" in str(caught.value)
    assert "memory_format=\"contiguous\"" in str(caught.value)
