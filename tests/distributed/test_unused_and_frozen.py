"""Parameters a step leaves out, frozen ones, and requires_grad flipped mid-run: k ranks = 1 device.

On one device a parameter no backward reached keeps `.grad = None` and the optimizer skips it
(no weight decay, momentum or Adam moment). Each case trains a two-headed model on 3 gloo ranks
(shards of 5, 4 and 3 rows: uneven) and, in the same process, on one device with torch alone,
and compares the weights (float64). Before usage.py the alternating heads ended 0.17 apart with
AdamW, a model with a frozen layer failed in `prepare`, a layer unfrozen after `prepare` left
each rank with its own weights, and `dp.optimizer` under ZeRO refused a frozen layer as "not
the replica's". The cases named `optimizer.zero_grad()` zero with the torch optimizer instead of
`dp.zero_grad()`: every `.grad` None, each taken back into its bucket as it lands (refused before).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.errors import UsageError
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

GLOBAL, STEPS = 12, 5
ROWS = {0: slice(0, 5), 1: slice(5, 9), 2: slice(9, 12)}  # 3 ranks, uneven


class Heads(nn.Module):
    """A trunk and two heads; `route` says which rows head b takes (None: the step's `head`)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, step: int, routing: str) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        if routing == "both":  # every trainable parameter, every step
            return self.a(h) + self.b(h)
        if routing == "alternate":  # a whole head unused on every rank, every other step
            return self.a(h) if step % 2 == 0 else self.b(h)
        take_b = x[:, 0] > 1.2  # by row: on some steps only one rank's rows reach head b
        out = self.a(h)
        if take_b.any():
            out = out.clone()
            out[take_b] = self.b(h[take_b])
        return out


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(GLOBAL, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (GLOBAL,), generator=g))
            for _ in range(STEPS)]


def _model(case: dict) -> Heads:
    torch.manual_seed(0)
    model = Heads().double()
    if case.get("frozen"):
        model.trunk.requires_grad_(False)
    return model


def _optimizer(params, case: dict) -> torch.optim.Optimizer:
    if case.get("optimizer") == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def _flip(model: nn.Module, step: int, case: dict) -> None:
    """The case's change of requires_grad at step 2: unfreeze the trunk, or freeze head a."""
    if step == 2 and case.get("flip") == "unfreeze":
        model.trunk.requires_grad_(True)
    if step == 2 and case.get("flip") == "freeze":
        model.a.requires_grad_(False)


def _one_device(case: dict) -> dict:
    model = _model(case)
    optimizer = _optimizer(model.parameters(), case)
    for step, (X, y) in enumerate(_batches()):
        if case.get("when") != "after zero_grad":
            _flip(model, step, case)
        optimizer.zero_grad()
        if case.get("when") == "after zero_grad":
            _flip(model, step, case)
        F.cross_entropy(model(X, step, case["routing"]), y).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _k_ranks(world, case: dict) -> dict:
    options = {k: case[k] for k in ("overlap", "grad_dtype", "algorithm") if k in case}
    dp = phalanx.prepare(_model(case), world=world, **options)
    optimizer = _optimizer(dp.parameters(), case)
    for step, (X, y) in enumerate(_batches()):
        X, y = X[ROWS[world.rank]], y[ROWS[world.rank]]
        if case.get("when") != "after zero_grad":
            _flip(dp.module, step, case)
        if case.get("zero") == "optimizer":  # set_to_none: each gradient taken back into its bucket
            optimizer.zero_grad()
        else:
            dp.zero_grad()
        if case.get("when") == "after zero_grad":
            _flip(dp.module, step, case)
        if case.get("accumulate"):  # two micro-batches; head b only reachable in the first
            for i, rows in enumerate(dp.accumulate([slice(0, 2), slice(2, None)])):
                out = dp(X[rows], step if i == 0 else 0, case["routing"])
                phalanx.shard_loss(F.cross_entropy(out, y[rows], reduction="sum"), GLOBAL).backward()
        else:
            out = dp(X, step, case["routing"])
            phalanx.shard_loss(F.cross_entropy(out, y, reduction="sum"), GLOBAL).backward()
        dp.finish_gradient_sync()
        optimizer.step()
    state = {k: v.detach().clone() for k, v in dp.state_dict().items()}
    dp.close()
    return state


def _sharded(world, stage: str, case: dict) -> dict:
    """Under ZeRO: a frozen trunk gets no shard and no gradient; a head no rank used keeps a zero
    shard gradient, and the sharded optimizer skips its pieces. Either way the optimizer skips it."""
    dp = phalanx.prepare(_model(case), world=world, shard=stage)
    optimizer = dp.optimizer(torch.optim.AdamW, lr=0.05, weight_decay=0.1)  # over dp's parameters, frozen too
    for step, (X, y) in enumerate(_batches()):
        X, y = X[ROWS[world.rank]], y[ROWS[world.rank]]
        dp.zero_grad()
        phalanx.shard_loss(F.cross_entropy(dp(X, step, case["routing"]), y, reduction="sum"), GLOBAL).backward()
        dp.finish_gradient_sync()
        optimizer.step()
    state = dp.full_state_dict()
    dp.close()
    return state


def _one_device_accumulated(case: dict) -> dict:
    """The accumulate case's 1-device run: each rank's first two rows at the step's routing, the rest at step 0's."""
    model = _model(case)
    optimizer = _optimizer(model.parameters(), case)
    for step, (X, y) in enumerate(_batches()):
        optimizer.zero_grad()
        loss = 0
        for rows in ROWS.values():
            Xr, yr = X[rows], y[rows]
            loss = loss + F.cross_entropy(model(Xr[:2], step, case["routing"]), yr[:2], reduction="sum")
            loss = loss + F.cross_entropy(model(Xr[2:], 0, case["routing"]), yr[2:], reduction="sum")
        (loss / GLOBAL).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


CASES = {
    "alternating heads, AdamW": dict(routing="alternate"),
    "alternating heads, SGD momentum": dict(routing="alternate", optimizer="sgd"),
    "alternating heads, overlapped": dict(routing="alternate", overlap=True),
    "alternating heads, after backward": dict(routing="alternate", overlap=False),
    "alternating heads, ring": dict(routing="alternate", algorithm="ring"),
    "rows routed, some ranks only": dict(routing="rows"),
    "rows routed, overlapped": dict(routing="rows", overlap=True),
    "frozen trunk": dict(routing="rows", frozen=True),
    "trunk unfrozen at step 2": dict(routing="alternate", frozen=True, flip="unfreeze"),
    "trunk unfrozen after zero_grad": dict(routing="alternate", frozen=True, flip="unfreeze", when="after zero_grad"),
    "trunk unfrozen after zero_grad, overlapped": dict(routing="rows", frozen=True, flip="unfreeze",
                                                       when="after zero_grad", overlap=True),
    "head a frozen at step 2": dict(routing="rows", flip="freeze"),
    "head a frozen after zero_grad": dict(routing="alternate", flip="freeze", when="after zero_grad"),
    "accumulated, head b in one micro-batch": dict(routing="alternate", accumulate=True),
    "optimizer.zero_grad(), rows routed": dict(routing="rows", zero="optimizer"),
    "optimizer.zero_grad(), alternating, overlapped": dict(routing="alternate", zero="optimizer", overlap=True),
    "optimizer.zero_grad(), trunk unfrozen at step 2": dict(routing="alternate", frozen=True, flip="unfreeze",
                                                            zero="optimizer"),
    "optimizer.zero_grad(), accumulated": dict(routing="alternate", accumulate=True, zero="optimizer"),
}


SHARDED = ("optimizer", "gradients", "parameters")
SHARDED_CASES = {"frozen trunk": dict(routing="both", frozen=True), "alternating heads": dict(routing="alternate")}


def _worker(world) -> dict:
    out = {}
    for name, case in CASES.items():
        out[name] = _k_ranks(world, case)
    for stage in SHARDED:
        for name, case in SHARDED_CASES.items():
            out[f"sharded {stage}, {name}"] = _sharded(world, stage, case)
    compressed = dict(routing="alternate", grad_dtype="bf16")  # flags summed in bf16 still read 0 exactly
    out["bf16"] = _k_ranks(world, compressed)
    dp = phalanx.prepare(_model(dict(frozen=True)), world=world, shard="optimizer")
    dp.module.trunk.requires_grad_(True)
    try:
        dp.zero_grad()
    except UsageError as exc:
        out["sharded flip"] = str(exc)
    dp.close()
    return out


@pytest.fixture(scope="module")
def results():
    return run_workers(_worker, 3, timeout_s=240)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("name", list(CASES))
def test_k_ranks_end_where_one_device_ends(results, name):
    case = CASES[name]
    reference = _one_device_accumulated(case) if case.get("accumulate") else _one_device(case)
    for rank in results:
        assert _max_diff(rank[name], reference) < 1e-12, (name, _max_diff(rank[name], reference))
    assert _max_diff(results[0][name], results[1][name]) == 0 and _max_diff(results[0][name], results[2][name]) == 0


@pytest.mark.parametrize("name", list(SHARDED_CASES))
@pytest.mark.parametrize("stage", SHARDED)
def test_under_zero_k_ranks_end_where_one_device_ends(results, stage, name):
    reference = _one_device(SHARDED_CASES[name])
    for rank in results:
        assert _max_diff(rank[f"sharded {stage}, {name}"], reference) < 1e-12


def test_a_head_no_rank_used_is_not_moved_with_compressed_gradients(results):
    """bf16 on the wire: not 1 device's float64 weights, but the unused head is skipped alike."""
    reference = _one_device(dict(routing="alternate"))
    for rank in results:
        assert _max_diff(rank["bf16"], reference) < 1e-2
        assert _max_diff(rank["bf16"], results[0]["bf16"]) == 0


def test_requires_grad_flipped_on_a_sharded_replica_is_one_line(results):
    for rank in results:
        message = rank["sharded flip"]
        assert message.startswith("trunk.weight.requires_grad changed after prepare(shard='optimizer')"), message
        assert "\n" not in message
