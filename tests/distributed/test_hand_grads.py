"""Gradients a script sets by hand are summed like autograd's, on 2 gloo workers against one device
(float64): `grads = torch.autograd.grad(loss, params)` then `p.grad = g` (meta-learning, a
functional loss, an RL update written out), or `p.grad.copy_(g)` into the slots `dp.zero_grad(set_to_none=False)`
left, then `finish_gradient_sync()` and the step. No
landing hook sees such a gradient, so the replica took its parameters for unused: every rank
dropped them and the optimizer skipped them, and k workers trained nothing while one device
trained (5% off after 3 SGD steps), silently. Every stage of sharding, with and without overlap,
and a step mixing both kinds (backward for one layer, a hand-set gradient for the other).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

BATCH, STEPS = 12, 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 3, generator=g, dtype=torch.float64), torch.randint(0, 2, (BATCH,), generator=g)


def _train(model_call, params, optimizer, *, rows: torch.Tensor, mixed: bool, in_place: bool = False,
           finish=lambda: None) -> None:
    for step in range(STEPS):
        X, y = _batch(step)
        optimizer.zero_grad(set_to_none=not in_place)
        loss = phalanx.shard_loss(F.cross_entropy(model_call(X[rows]), y[rows], reduction="sum"), BATCH)
        if mixed:  # the first layer by backward, the last by hand
            last = params[2:]
            grads = torch.autograd.grad(loss, last, retain_graph=True)
            loss.backward(inputs=params[:2])
            for p, g in zip(last, grads):
                p.grad = g
        elif in_place:  # into the gradients zero_grad left: the replica's bucket slots
            for p, g in zip(params, torch.autograd.grad(loss, params)):
                p.grad.copy_(g)
        else:
            for p, g in zip(params, torch.autograd.grad(loss, params)):
                p.grad = g
        finish()
        optimizer.step()


class _ZeroingByReplica:
    """The optimizer with the replica's zero_grad, which keeps the gradients as bucket slots."""

    def __init__(self, optimizer, dp) -> None:
        self.optimizer, self.dp = optimizer, dp

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.dp.zero_grad()

    def step(self) -> None:
        self.optimizer.step()


def _worker(world, shard: str, overlap: bool, mixed: bool, in_place: bool = False) -> float:
    reference = _model()
    params = list(reference.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    _train(reference, params, torch.optim.SGD(params, lr=0.1, momentum=0.9), rows=torch.arange(BATCH), mixed=mixed,
           in_place=in_place)
    dp = phalanx.prepare(_model(), world=world, shard=shard, overlap=overlap)
    mine = phalanx.rank_shard(torch.arange(BATCH), rank=world.rank, world_size=world.world_size)
    kwargs = dict(lr=0.1, momentum=0.9)
    optimizer = torch.optim.SGD(dp.parameters(), **kwargs) if shard == "none" else dp.optimizer(torch.optim.SGD, **kwargs)
    if in_place:
        dp.zero_grad(set_to_none=False)  # every gradient a zeroed bucket slot, as the script then writes into it
        optimizer = _ZeroingByReplica(optimizer, dp)
    _train(dp, list(dp.module.parameters()), optimizer, rows=mine, mixed=mixed, in_place=in_place,
           finish=dp.finish_gradient_sync)
    got = dp.full_state_dict() if shard != "none" else dp.state_dict()
    dp.close()
    want = reference.state_dict()
    return max(((got[k] - want[k]).abs().max() / want[k].abs().max()).item() for k in want)


@pytest.mark.parametrize("shard, overlap, mixed", [
    ("none", False, False), ("none", True, False), ("none", True, True), ("none", False, True),
    ("optimizer", True, False), ("gradients", False, True), ("parameters", True, False)])
def test_gradients_set_by_hand_are_summed_as_one_device_s(shard, overlap, mixed):
    worst = run_workers(_worker, 2, shard, overlap, mixed, timeout_s=90)
    assert max(worst) <= 1e-12, worst


@pytest.mark.parametrize("shard, overlap", [("none", False), ("none", True), ("optimizer", True)])
def test_gradients_written_by_hand_into_the_zeroed_slots_are_summed_as_one_device_s(shard, overlap):
    """`dp.zero_grad(set_to_none=False)` makes every gradient a zeroed bucket slot, `dp.zero_grad()` keeps
    them so; `p.grad.copy_(g)` writes there."""
    worst = run_workers(_worker, 2, shard, overlap, False, True, timeout_s=90)
    assert max(worst) <= 1e-12, worst


def _skip_or_replace(world, overlap: bool) -> dict:
    """`p.grad = None` after backward skips that parameter's update, as on one device; `p.grad =
    p.grad * 2` after backward (its bucket went out already) is refused, naming it."""
    X, y = _batch(0)
    rows = phalanx.rank_shard(torch.arange(BATCH), rank=world.rank, world_size=world.world_size)
    reference = _model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(STEPS):
        optimizer.zero_grad()
        phalanx.shard_loss(F.cross_entropy(reference(X), y, reduction="sum"), BATCH).backward()
        reference[0].weight.grad = None
        optimizer.step()
    dp = phalanx.prepare(_model(), world=world, overlap=overlap)
    optimizer = torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9)
    for _ in range(STEPS):
        dp.zero_grad()
        phalanx.shard_loss(F.cross_entropy(dp(X[rows]), y[rows], reduction="sum"), BATCH).backward()
        dp.module[0].weight.grad = None
        dp.finish_gradient_sync()
        optimizer.step()
    got, want = dp.state_dict(), reference.state_dict()
    worst = max(((got[k] - want[k]).abs().max() / want[k].abs().max()).item() for k in want)
    dp.zero_grad()
    phalanx.shard_loss(F.cross_entropy(dp(X[rows]), y[rows], reduction="sum"), BATCH).backward()
    dp.module[2].bias.grad = dp.module[2].bias.grad * 2
    try:
        dp.finish_gradient_sync()
        said = None
    except phalanx.UsageError as exc:
        said = str(exc)
    dp.close()
    return {"worst": worst, "said": said}


@pytest.mark.parametrize("overlap", [False, True])
def test_a_gradient_set_to_none_after_backward_is_skipped_and_one_replaced_is_named(overlap):
    for found in run_workers(_skip_or_replace, 2, overlap, timeout_s=90):
        assert found["worst"] <= 1e-12, found
        assert found["said"] is not None and found["said"].startswith(
            "the gradient of 2.bias was replaced between backward and finish_gradient_sync() (p.grad = ...): the "
            "exchange summed the gradient backward left in its bucket, not the new tensor"), found
