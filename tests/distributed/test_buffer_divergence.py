"""Buffers a forward updates from each rank's own data, compared with the replicas (guards/replicas.py).

A VQ-VAE's EMA codebook (a buffer moved in forward, under no_grad, toward the shard's own
encodings) drifts apart between ranks; DDP's `broadcast_buffers=True` would hide it by copying rank
0's. On 2 gloo workers phalanx.checkpoint stops at it in one line naming the buffer, how far apart,
and the fix, as close() and the periodic check do; a buffer every rank updates alike (a step
counter) and BatchNorm's statistics under the `local` policy, checked every step, stay silent.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phalanx
from phalanx.data_parallel.guards.checks import ReplicaMismatch
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

GLOBAL_BATCH, STEPS = 8, 3


class Codebook(nn.Module):
    """An encoder, an EMA codebook moved toward this shard's encodings (once `ema_on`), a step counter."""

    def __init__(self, batchnorm: bool = False) -> None:
        super().__init__()
        self.encode, self.decode = nn.Linear(5, 4), nn.Linear(4, 3)
        self.norm = nn.BatchNorm1d(4) if batchnorm else nn.Identity()
        self.register_buffer("codebook", torch.randn(6, 4))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.ema_on = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.encode(x))
        if self.training:
            with torch.no_grad():
                self.steps += 1
                if self.ema_on:
                    nearest = torch.cdist(h, self.codebook).argmin(1)
                    for k in range(self.codebook.shape[0]):
                        if (nearest == k).any():
                            self.codebook[k].mul_(0.9).add_(0.1 * h[nearest == k].mean(0))
        return self.decode(h)


def _train(world, out: str, *, ema_from_step: int | None, batchnorm: str, every: int) -> str:
    torch.manual_seed(0)
    dp = phalanx.prepare(Codebook(batchnorm == "local"), world=world, dtype="float64", batchnorm=batchnorm,
                         check_finite_every=every)
    optimizer = torch.optim.SGD(dp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    mine = phalanx.rank_shard(torch.arange(GLOBAL_BATCH), rank=world.rank, world_size=world.world_size)
    try:
        for step in range(STEPS):
            dp.module.ema_on = ema_from_step is not None and step >= ema_from_step
            x, y = torch.randn(GLOBAL_BATCH, 5, generator=g, dtype=torch.float64), torch.randn(GLOBAL_BATCH, 3, generator=g,
                                                                                              dtype=torch.float64)
            optimizer.zero_grad()
            phalanx.shard_loss(((dp(x[mine]) - y[mine]) ** 2).sum(), GLOBAL_BATCH).backward()
            dp.finish_gradient_sync()
            optimizer.step()
        phalanx.checkpoint(out, world=world, model=dp, optimizer=optimizer, epoch=1, global_batch_size=GLOBAL_BATCH,
                           seed=0)
        dp.close()
        return "ok"
    except ReplicaMismatch as exc:
        dp._close()  # the checks already ran (and raised) on every rank
        return str(exc)


def _worker(world, out: str) -> dict[str, str]:
    return {
        # The codebook moves from step 1 on: step 1's check (the first) passes; checked every 100 steps.
        "ema": _train(world, f"{out}/ema", ema_from_step=1, batchnorm="sync", every=100),
        "ema-periodic": _train(world, f"{out}/ema-periodic", ema_from_step=1, batchnorm="sync", every=2),
        "counter": _train(world, f"{out}/counter", ema_from_step=None, batchnorm="sync", every=1),
        "local-bn": _train(world, f"{out}/local-bn", ema_from_step=None, batchnorm="local", every=1),
    }


def test_a_buffer_each_rank_updates_from_its_own_data_stops_the_checkpoint(tmp_path):
    results = run_workers(_worker, 2, str(tmp_path), timeout_s=120)
    assert results[0] == results[1]  # every rank raises the same line
    ema = results[0]["ema"]
    assert ema.startswith("replicas diverged (found by phalanx.checkpoint() after step 3): rank 1's codebook "
                          "(a buffer) differs from rank 0's by up to "), ema
    assert "\n" not in ema and "phalanx.allreduce or phalanx.reduce the statistics" in ema and "broadcast" in ema
    assert results[0]["ema-periodic"].startswith("replicas diverged (found at step 2's check: the first step and every 2 steps): rank 1's codebook"), results[0]
    assert results[0]["counter"] == "ok" and results[0]["local-bn"] == "ok"
