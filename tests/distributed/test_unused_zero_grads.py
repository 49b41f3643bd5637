"""A parameter no rank used in a step keeps the gradient it had before backward, as on one device.

`zero_grad(set_to_none=False)` (torch's default before 2.0, and the `p.grad.zero_()` loop) leaves
every gradient a zero tensor, so on one device an unused parameter still gets momentum, weight
decay and an Adam step from its zero gradient; the default `zero_grad()` leaves None, and the
optimizer skips it. 2 gloo workers against one device (float64): a head used by every row at
step 0, by rank 0's rows only at step 2, by no row at steps 1, 3 and 4; SGD with momentum and
weight decay, and AdamW; unsharded and every stage of sharding. Taking "no rank used it" for
None left the weights 0.28 off one device with SGD and 0.17 with AdamW, which counted 2 steps
for the head where one device counts 5. Ranks that zero differently (one `set_to_none=False`, one
the default) keep the zeros on both, alike.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phalanx
from tests.distributed.harness import run_workers
from tests.distributed.one_device import assert_ranks_end_where_one_device_ends

pytestmark = pytest.mark.distributed

GLOBAL, STEPS = 10, 5
ROWS = {0: slice(0, 6), 1: slice(6, 10)}  # 2 ranks, uneven
HEAD_ROWS = {0: slice(0, 10), 2: slice(0, 3)}  # the rows that reach head b, by step: at step 2 only rank 0's


class Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, reach_b: torch.Tensor) -> torch.Tensor:
        out = self.a(x)
        if reach_b.any():  # head b in the graph only where some row reaches it
            out = out.clone()
            out[reach_b] = out[reach_b] + self.b(x[reach_b])
        return out


def _batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for step in range(STEPS):
        reach_b = torch.zeros(GLOBAL, dtype=torch.bool)
        reach_b[HEAD_ROWS.get(step, slice(0, 0))] = True
        out.append((torch.randn(GLOBAL, 3, generator=g, dtype=torch.float64),
                    torch.randn(GLOBAL, 2, generator=g, dtype=torch.float64), reach_b))
    return out


def _model() -> Heads:
    torch.manual_seed(0)
    return Heads().double()


def _optimizer_args(name: str) -> tuple[type, dict]:
    if name == "sgd":
        return torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.1)
    return torch.optim.AdamW, dict(lr=0.1, weight_decay=0.1)


def _zero(zero: str, optimizer, params, dp=None) -> None:
    """The case's zeroing: `set_to_none=False` through the optimizer (or the replica), the loop, or the default."""
    if zero == "loop":
        for param in params:
            if param.grad is not None:
                param.grad.zero_()
    elif zero == "dp set_to_none=False":
        dp.zero_grad(set_to_none=False)
    else:
        optimizer.zero_grad(set_to_none=zero != "set_to_none=False")


def _one_device(name: str, zero: str) -> dict:
    model = _model()
    cls, kwargs = _optimizer_args(name)
    optimizer = cls(model.parameters(), **kwargs)
    for X, Y, reach_b in _batches():
        _zero(zero, optimizer, list(model.parameters()))
        ((model(X, reach_b) - Y) ** 2).sum().div(GLOBAL).backward()
        optimizer.step()
    return _facts(model.state_dict(), model.b, optimizer)


def _k_ranks(world, name: str, zero: str, shard: str, options: dict) -> dict:
    torch_optimizer = options.pop("torch_optimizer", False)  # torch's own over dp.parameters(), as after DDP
    dp = phalanx.prepare(_model(), world=world, shard=shard, **options)
    cls, kwargs = _optimizer_args(name)
    optimizer = cls(dp.parameters(), **kwargs) if torch_optimizer else dp.optimizer(cls, **kwargs)
    rows = ROWS[world.rank]
    if zero == "ranks differ":  # a script that zeroes by rank: a rank that held zeros keeps them on every rank
        zero = "set_to_none=False" if world.rank == 0 else "default"
    for X, Y, reach_b in _batches():
        _zero(zero, optimizer, list(dp.parameters()), dp)
        loss = ((dp(X[rows], reach_b[rows]) - Y[rows]) ** 2).sum()
        phalanx.shard_loss(loss, GLOBAL).backward()
        dp.finish_gradient_sync()
        optimizer.step()
    state = dp.full_state_dict()
    facts = _facts(state, dp.module.b, optimizer if shard == "none" else None)
    dp.close()
    return facts


def _facts(state: dict, head: nn.Module, optimizer) -> dict:
    """The weights; unsharded also head b's gradient after the last step, and each of its Adam step counts."""
    facts = {"state": {k: v.detach().clone() for k, v in state.items()}}
    if optimizer is not None:
        facts["b grad"] = [None if p.grad is None else p.grad.detach().clone() for p in head.parameters()]
        facts["b steps"] = [float(optimizer.state[p]["step"]) if "step" in optimizer.state.get(p, {}) else None
                            for p in head.parameters()]
    return facts


ZEROS = ("set_to_none=False", "default")
CASES = {f"{name}, {shard}, {zero}": (name, zero, shard, {})
         for name in ("sgd", "adamw") for shard in ("none", "optimizer", "gradients", "parameters") for zero in ZEROS}
CASES.update({
    "sgd, none, loop": ("sgd", "loop", "none", {}),
    "adamw, none, dp set_to_none=False": ("adamw", "dp set_to_none=False", "none", {}),
    "adamw, optimizer, dp set_to_none=False": ("adamw", "dp set_to_none=False", "optimizer", {}),
    "sgd, none, set_to_none=False, overlapped": ("sgd", "set_to_none=False", "none", dict(overlap=True)),
    "adamw, none, set_to_none=False, torch's optimizer": ("adamw", "set_to_none=False", "none",
                                                          dict(torch_optimizer=True)),
    "adamw, none, default, torch's optimizer": ("adamw", "default", "none", dict(torch_optimizer=True)),
    "sgd, none, ranks differ": ("sgd", "ranks differ", "none", {}),
    "sgd, gradients, ranks differ": ("sgd", "ranks differ", "gradients", {}),
})


def _worker(world) -> dict:
    return {case: _k_ranks(world, name, zero, shard, dict(options))
            for case, (name, zero, shard, options) in CASES.items()}


@pytest.fixture(scope="module")
def results():
    return run_workers(_worker, 2, timeout_s=240)


@pytest.mark.parametrize("case", list(CASES))
def test_an_unused_head_ends_where_one_device_ends(results, case):
    name, zero, shard, _ = CASES[case]
    reference = _one_device(name, "default" if zero == "default" else "set_to_none=False")
    assert_ranks_end_where_one_device_ends(results, case, reference["state"])
    for rank in results if shard == "none" else []:
        assert rank[case]["b steps"] == reference["b steps"], case
        for mine, theirs in zip(rank[case]["b grad"], reference["b grad"]):  # None after the default, zeros otherwise
            assert (mine is None) == (theirs is None), case
            if theirs is not None:
                torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
