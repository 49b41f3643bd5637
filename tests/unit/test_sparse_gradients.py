"""An embedding with `sparse=True` through the replica's exchange, in a world of one (`exchange_alone`:
the buckets, hooks and sums of k devices, no process): its gradient is the plain loop's sparse
gradient after the sync, whether `dp.zero_grad()` kept the slots or `optimizer.zero_grad()` set them
to None (which crashed the first landing: a sparse tensor has no data pointer), with a row whose
gradient sums to exactly zero still present (Adagrad and SparseAdam update the state of every row
present); tied to a dense use, the gradient is dense, as on one device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from phalanx.data_parallel import DataParallel, DataParallelConfig
from phalanx.runtime.world import World

WORLD1 = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
               backend="none", timeout_s=10.0)
IDS = [torch.tensor([[1, 4], [4, 7], [7, 7]]), torch.tensor([[2, 2], [9, 1], [3, 3]])]


def _model(tied: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.ModuleDict({"emb": nn.Embedding(10, 3, sparse=True), "out": nn.Linear(3, 10)}).double()
    if tied:
        model["out"].weight = model["emb"].weight
    return model


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    hidden = model["emb"](ids).sum(1)
    # Row 5 enters twice with opposite signs: touched, its gradient exactly zero.
    cancel = model["emb"](torch.tensor([5])).sum() - model["emb"](torch.tensor([5])).sum()
    return model["out"](hidden).pow(2).sum() + cancel


def _grads(model: nn.Module, zero_grad, step) -> list[torch.Tensor]:
    seen = []
    for ids in IDS:
        zero_grad()
        _loss(model, ids).backward()
        step()
        seen.append(model["emb"].weight.grad.clone())
    return seen


@pytest.mark.parametrize("zero", ["replica", "optimizer"])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_sparse_embedding_keeps_one_device_s_sparse_gradient_through_the_exchange(zero, overlap):
    plain = _model()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.0)
    want = _grads(plain, optimizer.zero_grad, lambda: None)
    assert all(g.layout == torch.sparse_coo for g in want)
    with DataParallel(_model(), world=WORLD1, options=DataParallelConfig(overlap=overlap, exchange_alone=True)) as dp:
        optimizer = torch.optim.SGD(dp.parameters(), lr=0.0)
        got = _grads(dp.module, dp.zero_grad if zero == "replica" else optimizer.zero_grad, dp.finish_gradient_sync)
        for mine, theirs in zip(got, want):
            assert mine.layout == torch.sparse_coo and mine.is_coalesced()
            theirs = theirs.coalesce()
            assert torch.equal(mine.indices(), theirs.indices())  # row 5 present, its value zero
            torch.testing.assert_close(mine.values(), theirs.values(), rtol=1e-15, atol=0)
        assert got[1].indices()[0].tolist() == [1, 2, 3, 5, 9] and got[1].values()[3].abs().max() == 0
        dp.zero_grad()  # the slot again, until the next sync
        assert dp.module["emb"].weight.grad.layout == torch.strided


def test_rows_accumulate_until_zeroed_and_a_dense_use_of_the_table_makes_it_dense():
    with DataParallel(_model(), world=WORLD1, options=DataParallelConfig(exchange_alone=True)) as dp:
        dp.zero_grad()
        for ids in IDS:  # no zero_grad between the syncs: the rows of both steps, as one device keeps them
            _loss(dp.module, ids).backward()
            dp.finish_gradient_sync()
        assert dp.module["emb"].weight.grad.coalesce().indices()[0].tolist() == [1, 2, 3, 4, 5, 7, 9]
    plain = _model(tied=True)
    _loss(plain, IDS[0]).backward()
    assert plain["emb"].weight.grad.layout == torch.strided
    with DataParallel(_model(tied=True), world=WORLD1, options=DataParallelConfig(exchange_alone=True)) as dp:
        dp.zero_grad()
        _loss(dp.module, IDS[0]).backward()
        dp.finish_gradient_sync()
        assert dp.module["emb"].weight.grad.layout == torch.strided
        torch.testing.assert_close(dp.module["emb"].weight.grad, plain["emb"].weight.grad, rtol=1e-15, atol=0)
