"""Gradients carried from one optimizer step into the next without zero_grad: 2 workers = 1 device.

On one device a step without zero_grad before its backward steps with g_old + g_new. After a
sync every rank's buckets hold the same summed g_old, so each rank adding its share on top sent
g_old twice on 2 workers (1.4 off one device after 3 SGD steps), and stages 2 and 3, which
overwrote the shard gradient at each sync, dropped it. 2 gloo workers against one device, float64
to 1e-12: no zero_grad for 4 steps, and zero_grad every 2 steps (`dp.zero_grad()`, or the
optimizer's, which leaves None); SGD with momentum and AdamW; unsharded with and without overlap,
and every stage of sharding; a head used by every row at step 0, by rank 0's rows only at step 2,
by none at steps 1 and 3 (so it steps on the gradient it carries); an embedding with
`sparse=True`, whose sparse gradient carries its rows; micro-batches under `dp.accumulate` on top
of a carried sum; and a rank whose shard is empty at a step (it runs no backward). With
`average=True` (each rank's mean loss, equal shards) one device steps with g_old + mean(new):
under `shard="optimizer"` and stages 2 and 3 the carried g_old was divided by k too before
2026-12-02 (0.45 off one device after 4 SGD steps).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phalanx
from tests.distributed.harness import run_workers
from tests.distributed.one_device import assert_ranks_end_where_one_device_ends

pytestmark = pytest.mark.distributed

GLOBAL, STEPS = 10, 4
ROWS = {0: slice(0, 6), 1: slice(6, 10)}  # 2 ranks, uneven
EVEN_ROWS = {0: slice(0, 5), 1: slice(5, 10)}  # average=True: DDP's mean of means is one device's mean
HEAD_ROWS = {0: slice(0, 10), 2: slice(0, 3)}  # the rows that reach head b, by step: at step 2 only rank 0's


class Heads(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 3, sparse=sparse)
        self.a, self.b = nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, reach_b: torch.Tensor) -> torch.Tensor:
        x = x + self.embed(ids)
        out = self.a(x)
        if reach_b.any():  # head b in the graph only where some row reaches it
            out = out.clone()
            out[reach_b] = out[reach_b] + self.b(x[reach_b])
        return out


def _batches() -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for step in range(STEPS):
        reach_b = torch.zeros(GLOBAL, dtype=torch.bool)
        reach_b[HEAD_ROWS.get(step, slice(0, 0))] = True
        out.append((torch.randn(GLOBAL, 3, generator=g, dtype=torch.float64), torch.randint(7, (GLOBAL,), generator=g),
                    torch.randn(GLOBAL, 2, generator=g, dtype=torch.float64), reach_b))
    return out


def _model(sparse: bool) -> Heads:
    torch.manual_seed(0)
    return Heads(sparse).double()


def _optimizer_args(name: str) -> tuple[type, dict]:
    if name == "sgd":
        return torch.optim.SGD, dict(lr=0.1, momentum=0.9)
    return torch.optim.AdamW, dict(lr=0.1, weight_decay=0.1)


def _zeroes(zero: str, step: int) -> bool:
    return zero == "every 2" and step % 2 == 0 or zero == "dp every 2" and step % 2 == 1


def _one_device(name: str, zero: str, sparse: bool, average: bool = False) -> dict:
    model = _model(sparse)
    cls, kwargs = _optimizer_args(name)
    optimizer = cls(model.parameters(), **kwargs)
    for step, (X, ids, Y, reach_b) in enumerate(_batches()):
        if _zeroes(zero, step):
            optimizer.zero_grad()
        ((model(X, ids, reach_b) - Y) ** 2).sum().div(GLOBAL * (2 if average else 1)).backward()
        optimizer.step()
    return _facts(model.state_dict(), model)


def _k_ranks(world, name: str, zero: str, shard: str, options: dict) -> dict:
    sparse, micro, empty_at = options.pop("sparse", False), options.pop("micro", 1), options.pop("empty_at", None)
    dp = phalanx.prepare(_model(sparse), world=world, shard=shard, **options)
    cls, kwargs = _optimizer_args(name)
    optimizer = dp.optimizer(cls, **kwargs)
    for step, (X, ids, Y, reach_b) in enumerate(_batches()):
        if _zeroes(zero, step):
            (dp.zero_grad if zero.startswith("dp") else optimizer.zero_grad)()
        rows = ROWS[world.rank] if step != empty_at else (slice(0, GLOBAL) if world.rank == 0 else slice(0, 0))
        if options.get("average"):
            rows = EVEN_ROWS[world.rank]
        pieces = torch.arange(GLOBAL)[rows].tensor_split(micro)
        for piece in dp.accumulate([p for p in pieces if p.numel()]):  # none: this rank runs no backward
            loss = ((dp(X[piece], ids[piece], reach_b[piece]) - Y[piece]) ** 2).sum()
            (loss.div(2 * len(piece)) if options.get("average") else phalanx.shard_loss(loss, GLOBAL)).backward()
        dp.finish_gradient_sync()
        optimizer.step()
    facts = _facts(dp.full_state_dict(), dp.module if shard == "none" else None)
    dp.close()
    return facts


def _facts(state: dict, model: nn.Module | None) -> dict:
    """The weights; unsharded also each gradient after the last step (dense, for the comparison)."""
    facts = {"state": {k: v.detach().clone() for k, v in state.items()}}
    if model is not None:
        facts["grads"] = {n: None if p.grad is None else p.grad.detach().to_dense().clone()
                          for n, p in model.named_parameters()}
    return facts


CASES = {f"{name}, {shard}, {zero}": (name, zero, shard, {})
         for name in ("sgd", "adamw") for shard in ("none", "optimizer", "gradients", "parameters")
         for zero in ("never", "every 2")}
CASES.update({
    f"{name}, none, {zero}, overlap={overlap}": (name, zero, "none", dict(overlap=overlap))
    for name in ("sgd", "adamw") for zero in ("never", "dp every 2") for overlap in (True, False)})
CASES.update({
    "sgd, none, never, sparse embedding": ("sgd", "never", "none", dict(sparse=True)),
    "sgd, none, every 2, sparse embedding, overlap": ("sgd", "every 2", "none", dict(sparse=True, overlap=True)),
    "adamw, optimizer, dp every 2": ("adamw", "dp every 2", "optimizer", {}),
    "sgd, parameters, dp every 2": ("sgd", "dp every 2", "parameters", {}),
    # Micro-batches under no_sync on top of a carried sum, and a rank whose shard is empty at step 1 (no backward).
    "sgd, none, never, 2 micro-batches, overlap": ("sgd", "never", "none", dict(micro=2, overlap=True)),
    "adamw, optimizer, never, 2 micro-batches": ("adamw", "never", "optimizer", dict(micro=2)),
    "sgd, none, never, rank 1 empty at step 1": ("sgd", "never", "none", dict(empty_at=1)),
    "sgd, none, never, rank 1 empty at step 1, overlap": ("sgd", "never", "none", dict(empty_at=1, overlap=True)),
    "adamw, optimizer, never, rank 1 empty at step 1": ("adamw", "never", "optimizer", dict(empty_at=1)),
    "sgd, gradients, never, rank 1 empty at step 1": ("sgd", "never", "gradients", dict(empty_at=1)),
})
CASES.update({  # average=True: each rank's mean loss over an even shard
    f"{name}, {shard}, {zero}, average": (name, zero, shard, dict(average=True))
    for name in ("sgd", "adamw") for shard in ("none", "optimizer", "gradients", "parameters")
    for zero in ("never", "every 2")})


def _bypassed(world) -> str:
    """A carried sum, then a backward through `dp.module` (not the replica's forward): refused at the sync."""
    dp = phalanx.prepare(_model(False), world=world)
    rows = ROWS[world.rank]
    X, ids, Y, reach_b = _batches()[0]
    try:
        for _ in range(2):
            phalanx.shard_loss(((dp.module(X[rows], ids[rows], reach_b[rows]) - Y[rows]) ** 2).sum(), GLOBAL).backward()
            dp.finish_gradient_sync()
    except phalanx.UsageError as error:
        return str(error)
    finally:
        dp.zero_grad()
        dp.close()
    return "not refused"


def _worker(world) -> dict:
    out = {case: _k_ranks(world, name, zero, shard, dict(options))
           for case, (name, zero, shard, options) in CASES.items()}
    return {**out, "bypassed": _bypassed(world)}


@pytest.fixture(scope="module")
def results():
    return run_workers(_worker, 2, timeout_s=240)


@pytest.mark.parametrize("case", list(CASES))
def test_carried_gradients_end_where_one_device_ends(results, case):
    name, zero, shard, options = CASES[case]
    reference = _one_device(name, zero, options.get("sparse", False), options.get("average", False))
    assert_ranks_end_where_one_device_ends(results, case, reference["state"])
    for rank in results if shard == "none" else []:
        for key, theirs in reference["grads"].items():
            mine = rank[case]["grads"][key]
            assert (mine is None) == (theirs is None), (case, key)
            if theirs is not None:
                torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-12, msg=f"{case}: {key} grad")


def test_a_carried_sum_met_by_a_backward_not_through_the_replica_is_refused_on_every_rank(results):
    for rank in results:
        assert "no forward through the replica" in rank["bypassed"], rank["bypassed"]
