"""A loss over tokens with padding (a language model's): k ranks equal one device when each rank's
token-loss *sum* is divided by the global batch's token count (`phalanx.reduce(n, op="sum")` into
`shard_loss`), with and without accumulation, and do not when each rank averages its own tokens.

Sequences of 3-9 tokens padded to 9 (labels -100 where padded, torch's ignore_index), a global
batch of 7 over 3 ranks (shards of 3, 2 and 2 sequences, so different token counts), AdamW for 3
steps in float64. One device: `cross_entropy(..., reduction="mean")` over the whole batch, the
mean over its real tokens. With `dp.accumulate(2)` the count is the step's, over both pieces (the
bug Hugging Face's Trainer fixed in 2024 with `num_items_in_batch`). The per-rank mean (DDP's
habit: each rank's mean over its own tokens, averaged) is checked to differ, so the test can fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.data import split_batch
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

VOCAB, LENGTH, GLOBAL_BATCH, STEPS = 11, 9, 7, 3


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, LENGTH), generator=g)
        lengths = torch.randint(3, LENGTH + 1, (GLOBAL_BATCH,), generator=g)
        labels = torch.where(torch.arange(LENGTH) < lengths[:, None], torch.roll(tokens, -1, dims=1), -100)
        batches.append((tokens, labels))
    return batches


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Tanh(), nn.Linear(8, VOCAB)).double()


def _token_sum(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum")


def _worker(world, way: str) -> dict:
    dp = phalanx.prepare(_model(), world=world)
    optimizer = torch.optim.AdamW(dp.parameters(), lr=0.05)
    for tokens, labels in _batches():
        mine = split_batch(tokens, labels, world.world_size)[world.rank]
        dp.zero_grad()
        if way == "per-rank-mean":  # each rank's mean over its own tokens, averaged over ranks
            loss = _token_sum(dp, *mine) / (mine[1] != -100).sum() / world.world_size
            loss.backward()
        else:
            tokens_global = int(phalanx.reduce((mine[1] != -100).sum(), op="sum", world=world))
            pieces = dp.accumulate(split_batch(*mine, 2)) if way == "accumulate" else [mine]
            for X, y in pieces:  # the count is the step's, over every piece of every rank
                phalanx.shard_loss(_token_sum(dp, X, y), tokens_global).backward()
        dp.finish_gradient_sync()
        optimizer.step()
    state = {k: v.detach().clone() for k, v in dp.module.state_dict().items()}
    dp.close()
    return state


def test_token_losses_divided_by_the_global_token_count_equal_one_device():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    for tokens, labels in _batches():
        optimizer.zero_grad()
        F.cross_entropy(model(tokens).reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100).backward()
        optimizer.step()
    want = model.state_dict()

    def worst(state: dict) -> float:
        return max(((state[k] - w).abs().max() / w.abs().max()).item() for k, w in want.items())

    for way in ("global-count", "accumulate"):
        ranks = run_workers(_worker, 3, way, timeout_s=120)
        assert worst(ranks[0]) <= 1e-12, (way, worst(ranks[0]))
        assert all(torch.equal(ranks[r][k], ranks[0][k]) for r in (1, 2) for k in want), way
    assert worst(run_workers(_worker, 3, "per-rank-mean", timeout_s=120)[0]) > 1e-6  # DDP's habit is off
