"""A script's checkpoint resumes across shardings exactly, param groups and tied weights included.

A small language model whose output layer is tied to its embedding, AdamW over two param groups
in an order other than the module's (a LayerNorm-first group with its own lr, or the usual
decay / no-decay split), and a hand-halved lr (a group hyperparameter only the saved groups
hold): 3 steps, `phalanx.checkpoint`, a new replica with another `shard=`, `phalanx.resume`, 3
more steps, against 6 uninterrupted steps, 2 workers, float64. Before 2026-12-02 a whole
checkpoint's optimizer state was read into a sharded replica in the module's parameter order
where torch numbers it in the groups' order: the moments of one parameter went to another,
silently where the shapes allowed (0.12-0.36 relative off), a raw broadcast error where not; and
a tied weight's second name broke both directions (a missing key; a write into a parameter
whose elements share memory). A whole checkpoint saved before the names were kept still loads
where the order is the module's (one group over every parameter), and is one line otherwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from tests.distributed.resumed import resumed_relative_error, whole_state

pytestmark = pytest.mark.distributed

STEPS, SAVED_AT, ROWS = 6, 3, 12


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(12, 8)
        self.mixer = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 12, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(self.mixer(self.embedding(ids)))))


def _groups(model: TiedLM, style: str) -> list[dict]:
    if style == "norm-first":  # the optimizer's order is not the module's
        return [{"params": list(model.norm.parameters()), "lr": 3e-2},
                {"params": [model.mixer.weight, model.embedding.weight, model.mixer.bias], "lr": 1e-2}]
    if style == "decay":
        return [{"params": [p for p in model.parameters() if p.ndim > 1], "weight_decay": 0.1},
                {"params": [p for p in model.parameters() if p.ndim <= 1], "weight_decay": 0.0}]
    return [{"params": list(model.parameters())}]  # "one": a single group over everything


def _replica(world, shard: str, style: str):
    torch.manual_seed(0)
    dp = phalanx.prepare(TiedLM(), world=world, shard=shard)
    groups = _groups(dp.module, style)
    optimizer = (dp.optimizer(torch.optim.AdamW, params=groups, lr=1e-2) if shard != "none"
                 else torch.optim.AdamW(groups, lr=1e-2))
    return dp, optimizer


def _steps(world, dp, optimizer, first: int, last: int) -> None:
    g = torch.Generator().manual_seed(7)
    ids, targets = torch.randint(0, 12, (STEPS, ROWS), generator=g), torch.randint(0, 12, (STEPS, ROWS), generator=g)
    mine = phalanx.rank_shard(torch.arange(ROWS), rank=world.rank, world_size=world.world_size)
    for step in range(first, last):
        if step == 2:
            for group in optimizer.param_groups:
                group["lr"] *= 0.5  # by hand: only the saved param groups remember it
        optimizer.zero_grad()
        loss_sum = F.cross_entropy(dp(ids[step][mine]), targets[step][mine], reduction="sum")
        phalanx.shard_loss(loss_sum, ROWS).backward()
        dp.finish_gradient_sync()
        optimizer.step()


def _uninterrupted_and_resumed(directory: str, saved_with: str, resumed_with: str, style: str,
                               forget_names: bool) -> tuple[float, str | None]:
    torch.set_default_dtype(torch.float64)
    world = phalanx.init()
    dp, optimizer = _replica(world, "none", style)
    _steps(world, dp, optimizer, 0, STEPS)
    reference = whole_state(dp)
    dp.close()

    dp, optimizer = _replica(world, saved_with, style)
    _steps(world, dp, optimizer, 0, SAVED_AT)
    where = Path(directory) / "checkpoints"
    phalanx.checkpoint(where, world=world, model=dp, optimizer=optimizer, epoch=0, step=SAVED_AT,
                       global_batch_size=ROWS, seed=0)
    dp.close()
    if forget_names and world.is_main:  # as a checkpoint saved before the names were kept
        state = torch.load(where / "checkpoint.pt", weights_only=True)
        del state["optimizer_names"]
        torch.save(state, where / "checkpoint.pt")
    phalanx.barrier(world=world)

    return resumed_relative_error(world, where, lambda: _replica(world, resumed_with, style),
                                  lambda dp, optimizer: _steps(world, dp, optimizer, SAVED_AT, STEPS), reference,
                                  saved_at=SAVED_AT, global_batch_size=ROWS)


@pytest.mark.parametrize("saved_with, resumed_with, style", [
    ("none", "optimizer", "norm-first"),
    ("none", "parameters", "decay"),
    ("parameters", "none", "decay"),
    ("gradients", "parameters", "norm-first"),
    ("none", "none", "decay"),
])
def test_a_checkpoint_resumes_into_another_sharding_as_if_uninterrupted(tmp_path, saved_with, resumed_with, style):
    results = phalanx.launch(_uninterrupted_and_resumed, str(tmp_path), saved_with, resumed_with, style, False,
                             devices="cpu:2", timeout_s=120, quiet=True)
    for worst, error in results:
        assert error is None, error
        assert worst <= 1e-12, f"{worst:.3g} relative from the uninterrupted run"


def test_an_older_whole_checkpoint_loads_by_the_module_order_only_where_that_is_the_optimizers(tmp_path):
    one = phalanx.launch(_uninterrupted_and_resumed, str(tmp_path / "one"), "none", "optimizer", "one", True,
                         devices="cpu:2", timeout_s=120, quiet=True)
    assert all(error is None and worst <= 1e-12 for worst, error in one), one
    groups = phalanx.launch(_uninterrupted_and_resumed, str(tmp_path / "groups"), "none", "optimizer", "norm-first",
                            True, devices="cpu:2", timeout_s=120, quiet=True)
    for worst, error in groups:
        assert error is not None and "its 2 param groups were saved before phalanx kept their parameters' names" \
            in error and "resume it with shard=\"none\", save again" in error, error
