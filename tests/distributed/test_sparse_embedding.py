"""An embedding with `sparse=True` on 2 gloo workers against one device (float64), one spawn for all:

- its gradient after the sync is one device's sparse gradient (coalesced): the rows any rank touched,
  a row the two ranks pushed to an exactly zero sum among them, and on a rank that ran no backward
  at all (its shard empty: its gradient None after `optimizer.zero_grad()`) the same gradient;
- so SGD with momentum (a sparse buffer), Adagrad and SparseAdam, an `nn.EmbeddingBag(mode="sum")`,
  with `dp.zero_grad()` or `optimizer.zero_grad()` (which crashed the first backward), overlapped
  and not, end where one device ends;
- optimizer state saved on one device resumes on two and back (a sparse momentum buffer met a dense
  gradient: `add(sparse, dense)` refused);
- under `shard="gradients"` and `"parameters"` (a dense<-sparse copy crashed the first sync) the
  sparse gradient is summed dense into the flat buffer, and SGD with momentum ends where one device's ends.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import phalanx
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

VOCAB, GLOBAL = 12, 8
CUTS = (4, 4, 8)  # rank 0's rows of each step's global batch; at the last, rank 1's shard is empty
OPTIMIZERS = ("sgd", "adagrad", "sparse_adam")


def _model(bag: bool) -> nn.Module:
    torch.manual_seed(0)
    first = nn.EmbeddingBag(VOCAB, 3, mode="sum", sparse=True) if bag else nn.Embedding(VOCAB, 3, sparse=True)
    return nn.Sequential(first, nn.Flatten(), nn.Linear(3 if bag else 6, 1)).double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB - 1, (GLOBAL, 2), generator=g)
    coef = torch.zeros(GLOBAL, dtype=torch.float64)
    if step == 1:  # the first and last examples look up row 11 alone, with opposite signs: a sum of exactly 0
        ids[0] = ids[-1] = VOCAB - 1
        coef[0], coef[-1] = 1.0, -1.0
    return ids, torch.randn(GLOBAL, generator=g, dtype=torch.float64), coef


def _loss(model: nn.Module, ids, y, coef, rows: slice) -> torch.Tensor:
    out = model(ids[rows]).squeeze(-1)
    square = (coef[rows] == 0).double()
    return phalanx.shard_loss((coef[rows] * out + square * (out - y[rows]) ** 2).sum(), GLOBAL)


def _optimizers(model: nn.Module, name: str) -> list[torch.optim.Optimizer]:
    if name == "sgd":
        return [torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)]
    if name == "adagrad":
        return [torch.optim.Adagrad(model.parameters(), lr=0.1)]
    table, rest = list(model[0].parameters()), list(model[2].parameters())
    return [torch.optim.SparseAdam(table, lr=0.1), torch.optim.SGD(rest, lr=0.1)]


def _steps(model, optimizers, *, rank: int | None, zero, finish, steps=range(len(CUTS))) -> list[torch.Tensor]:
    """Train `steps`; rank None is one device (the whole batch). Returns the table's gradient after each sync."""
    grads = []
    for step in steps:
        zero()
        ids, y, coef = _batch(step)
        cut = CUTS[step]
        rows = slice(None) if rank is None else (slice(0, cut) if rank == 0 else slice(cut, GLOBAL))
        if rank != 1 or cut < GLOBAL:  # an empty shard runs no backward at all
            _loss(model, ids, y, coef, rows).backward()
        finish()
        grad = model[0].weight.grad  # (None on a sharded replica: the optimizer steps its shard's)
        grads.append(None if grad is None else grad.clone())
        for optimizer in optimizers:
            optimizer.step()
    return grads


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _zeroing(dp, optimizers, how: str):
    if how == "replica":
        return dp.zero_grad
    return lambda: [optimizer.zero_grad() for optimizer in optimizers]


def _workers(world, saved_on_one: dict) -> dict:
    out = {}
    for overlap in (False, True):
        for bag, name, how in [(False, o, h) for o in OPTIMIZERS for h in ("replica", "optimizer")] + \
                              [(True, "sgd", "optimizer")]:
            with phalanx.prepare(_model(bag), world=world, overlap=overlap) as dp:
                optimizers = _optimizers(dp.module, name)
                grads = _steps(dp.module, optimizers, rank=world.rank, zero=_zeroing(dp, optimizers, how),
                               finish=dp.finish_gradient_sync)
                out[(overlap, bag, name, how)] = (grads, _state(dp.module))
    # Resumed from one device's state after step 0 (momentum sparse); and saved here for one device to resume.
    # (A private copy: the argument's tensors arrive in memory the two workers share.)
    saved_on_one = copy.deepcopy(saved_on_one)
    with phalanx.prepare(_model(False), world=world) as dp:
        optimizers = _optimizers(dp.module, "sgd")
        dp.load_state_dict(saved_on_one["model"])
        optimizers[0].load_state_dict(saved_on_one["optimizer"])
        _steps(dp.module, optimizers, rank=world.rank, zero=dp.zero_grad, finish=dp.finish_gradient_sync,
               steps=range(1, len(CUTS)))
        out["resumed"] = _state(dp.module)
    with phalanx.prepare(_model(False), world=world) as dp:
        optimizers = _optimizers(dp.module, "sgd")
        _steps(dp.module, optimizers, rank=world.rank, zero=dp.zero_grad, finish=dp.finish_gradient_sync,
               steps=range(1))
        out["saved"] = {"model": _state(dp.module), "optimizer": optimizers[0].state_dict()}
    for shard in ("gradients", "parameters"):
        with phalanx.prepare(_model(False), world=world, shard=shard) as dp:
            optimizer = dp.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
            # (The first two steps: under stage 3 a forward is a collective, which an empty shard must join.)
            _steps(dp.module, [optimizer], rank=world.rank, zero=optimizer.zero_grad, finish=dp.finish_gradient_sync,
                   steps=range(2))
            out[shard] = dp.full_state_dict()
    return out


def _one_device(bag: bool, name: str, steps=range(len(CUTS)), model=None, optimizers=None):
    model = _model(bag) if model is None else model
    optimizers = _optimizers(model, name) if optimizers is None else optimizers
    grads = _steps(model, optimizers, rank=None, zero=lambda: [o.zero_grad() for o in optimizers],
                   finish=lambda: None, steps=steps)
    return grads, model, optimizers


@pytest.fixture(scope="module")
def runs():
    _, model, optimizers = _one_device(False, "sgd", steps=range(1))
    assert optimizers[0].state[model[0].weight]["momentum_buffer"].is_sparse
    saved = {"model": _state(model), "optimizer": optimizers[0].state_dict()}
    return run_workers(_workers, 2, saved, timeout_s=240)


def _assert_states(got: dict, want: dict) -> None:
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-12, atol=1e-14, msg=key)


@pytest.mark.parametrize("overlap", [False, True])
def test_two_workers_hand_the_optimizer_one_device_s_sparse_gradient_and_end_where_it_ends(runs, overlap):
    cases = {key for key in runs[0] if isinstance(key, tuple) and key[0] == overlap}
    assert len(cases) == 7
    for _, bag, name, how in sorted(cases):
        want_grads, model, _ = _one_device(bag, name)
        for rank in runs:  # rank 1 ran no backward at the last step, and holds the same gradient
            grads, state = rank[(overlap, bag, name, how)]
            for step, (got, want) in enumerate(zip(grads, want_grads)):
                want = want.coalesce()
                assert got.layout == torch.sparse_coo and got.is_coalesced(), (bag, name, how, step)
                assert torch.equal(got.indices(), want.indices()), (bag, name, how, step)  # row 11 at step 1
                torch.testing.assert_close(got.values(), want.values(), rtol=1e-12, atol=1e-14)
            _assert_states(state, _state(model))


def test_optimizer_state_resumes_from_one_device_on_two_and_from_two_on_one(runs):
    _, whole, _ = _one_device(False, "sgd")
    for rank in runs:
        _assert_states(rank["resumed"], _state(whole))
    saved = runs[0]["saved"]
    assert saved["optimizer"]["state"][0]["momentum_buffer"].is_sparse  # as one device's
    model = _model(False)
    model.load_state_dict(saved["model"])
    optimizers = _optimizers(model, "sgd")
    optimizers[0].load_state_dict(saved["optimizer"])
    _one_device(False, "sgd", steps=range(1, len(CUTS)), model=model, optimizers=optimizers)
    _assert_states(_state(model), _state(whole))


@pytest.mark.parametrize("shard", ["gradients", "parameters"])
def test_sharded_replicas_sum_a_sparse_gradient_dense_and_end_where_one_device_ends(runs, shard):
    _, whole, _ = _one_device(False, "sgd", steps=range(2))
    for rank in runs:
        _assert_states(rank[shard], _state(whole))
