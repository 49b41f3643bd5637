"""A stage-3 replica's parameters between steps (`shard="parameters"`), on 2 gloo workers, float64.

At rest each rank holds only its range of a parameter, and the parameter is a stand-in of its shape.
Reading one there gave NaN without a word (a weight norm, an EMA updated from `dp.module`), and an
in-place write was lost (a 1-element bias's `fill_`) or died in a torch error whose advice lost it
too; a copy of the module failed to pickle the communication. Now a read or write at rest is one
line naming `dp.gathered_parameters()`, inside which the parameters are whole: an EMA
(`AveragedModel`) built and updated there equals the unsharded run's, WGAN's weight clipping with
`writeback=True` equals 1 device, and an edit made without writeback, or differently on each rank,
is refused; `dp.close()` leaves the model whole and plain (before 2026-12-05 it stayed at rest,
unreadable, with the block it named gone with the replica). Also: a 0-d parameter trains at stage 3
as on 1 device, and an embedding with `max_norm` (each rank renormalizes the rows it looks up) is
refused on 2 ranks, fine on 1.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import phalanx
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed
STEPS, BATCH = 3, 8


class Scaled(nn.Module):
    """Two layers and a learnable 0-d temperature (CLIP's logit scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(3, 5), nn.Linear(5, 2)
        self.temperature = nn.Parameter(torch.tensor(0.7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x))) * self.temperature


def _model() -> nn.Module:
    torch.manual_seed(0)
    return Scaled().double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, BATCH, 3, generator=g, dtype=torch.float64), torch.randn(STEPS, BATCH, 2, generator=g,
                                                                                         dtype=torch.float64)


def _clip(module: nn.Module) -> None:
    with torch.no_grad():
        for param in module.parameters():
            param.clamp_(-0.3, 0.3)


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _train(world, shard: str, *, clip: bool) -> dict:
    """STEPS steps of SGD; after each, inside the block: the EMA's update, and (`clip`) the clipping."""
    model = _model()
    dp = phalanx.prepare(model, world=world, shard=shard)
    optimizer = dp.optimizer(torch.optim.SGD, lr=0.2)
    with dp.gathered_parameters():
        ema = AveragedModel(dp.module, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    x, y = _data()
    mine = phalanx.rank_shard(torch.arange(BATCH), rank=world.rank, world_size=world.world_size)
    for step in range(STEPS):
        optimizer.zero_grad()
        phalanx.shard_loss(((dp(x[step][mine]) - y[step][mine]) ** 2).sum(), BATCH).backward()
        dp.finish_gradient_sync()
        optimizer.step()
        with dp.gathered_parameters(writeback=clip):
            if clip:
                _clip(dp.module)
            ema.update_parameters(dp.module)
    with dp.gathered_parameters():
        whole = _flat(dp.module)
    dp.close()  # the model whole again: before 2026-12-05 stage 3's stayed at rest, unreadable for good
    return {"params": whole, "ema": _flat(ema.module), "ema types": {type(p) for p in ema.module.parameters()},
            "closed": _flat(model), "closed types": {type(p) for p in model.parameters()}}


def _one_device(*, clip: bool) -> torch.Tensor:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    x, y = _data()
    for step in range(STEPS):
        optimizer.zero_grad()
        (((model(x[step]) - y[step]) ** 2).sum() / BATCH).backward()
        optimizer.step()
        if clip:
            _clip(model)
    return _flat(model)


def _both(world, clip: bool) -> dict:
    return {"none": _train(world, "none", clip=clip), "parameters": _train(world, "parameters", clip=clip)}


@pytest.mark.parametrize("clip", [False, True])
def test_ema_and_clipping_inside_the_block_equal_unsharded_and_one_device(clip):
    results = run_workers(_both, 2, clip, timeout_s=180)
    want = _one_device(clip=clip)
    for out in results:
        sharded, unsharded = out["parameters"], out["none"]
        assert (sharded["params"] - want).abs().max().item() <= 1e-12  # the 0-d temperature included
        assert (unsharded["params"] - want).abs().max().item() <= 1e-12
        assert (sharded["ema"] - unsharded["ema"]).abs().max().item() <= 1e-12
        assert sharded["ema types"] == {nn.Parameter}  # an ordinary model, not the replica's parameters
        for closed in (sharded, unsharded):  # after dp.close() the model is whole and plain, as trained
            assert torch.equal(closed["closed"], closed["params"]) and closed["closed types"] == {nn.Parameter}


def _one_line(call) -> str:
    try:
        call()
    except (RuntimeError, TypeError) as exc:
        return str(exc)
    return "no error"


@torch.no_grad()
def _fill(tensor: torch.Tensor, value: float) -> None:
    tensor.fill_(value)


def _misuse(world) -> dict:
    dp = phalanx.prepare(_model(), world=world, shard="parameters")
    optimizer = dp.optimizer(torch.optim.SGD, lr=0.2)
    x, y = _data()
    optimizer.zero_grad()
    phalanx.shard_loss(((dp(x[0][:4]) - y[0][:4]) ** 2).sum(), 8).backward()
    dp.finish_gradient_sync()
    optimizer.step()
    with dp.gathered_parameters():
        before = _flat(dp.module)
    found = {
        "norm at rest": _one_line(lambda: dp.module.first.weight.norm()),
        "fill_ at rest": _one_line(lambda: _fill(dp.module.second.bias, 7.0)),  # 1 element: was dropped silently
        "0-d write at rest": _one_line(lambda: _fill(dp.module.temperature, 2.0)),
        "AveragedModel at rest": _one_line(lambda: AveragedModel(dp.module)),
        "torch.save(dp.module)": _one_line(lambda: torch.save(dp.module, io.BytesIO())),
    }

    def edit_without_writeback():
        with dp.gathered_parameters(), torch.no_grad():
            dp.module.second.bias.fill_(7.0)

    def edit_apart():
        with dp.gathered_parameters(writeback=True), torch.no_grad():
            dp.module.second.bias.fill_(float(world.rank))

    found["edit without writeback"] = _one_line(edit_without_writeback)
    found["edits apart"] = _one_line(edit_apart)
    with dp.gathered_parameters():
        found["unchanged"] = bool(torch.equal(_flat(dp.module), before))
    dp.close()
    return found


def test_touching_parameters_at_rest_is_one_line_naming_the_block():
    for found in run_workers(_misuse, 2, timeout_s=120):
        assert found.pop("unchanged")  # nothing refused was kept
        for what, line in found.items():
            assert "\n" not in line, what
            if what == "torch.save(dp.module)":  # its own parameter at rest, or (a child's) the replica's hooks
                assert "cannot be pickled" in line and "dp.gathered_parameters()" in line, line
            elif what == "edit without writeback":
                assert "pass writeback=True" in line, line
            elif what == "edits apart":
                assert "differ between ranks (rank 1 from rank 0's)" in line, line
            else:
                assert "cannot be" in line and "between steps" in line, (what, line)
                assert "dp.gathered_parameters()" in line, line


def _embedding(world, shard: str) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Flatten(), nn.Linear(8, 1)).double()
    try:
        dp = phalanx.prepare(model, world=world, shard=shard)
    except ValueError as exc:
        return str(exc)
    dp(torch.tensor([[0, 1], [2, 3]])).sum().backward()
    dp.close()
    return "prepared"


@pytest.mark.parametrize("shard", ["none", "parameters"])
def test_an_embedding_with_max_norm_is_refused_on_two_ranks_only(shard):
    for line in run_workers(_embedding, 2, shard, timeout_s=120):
        assert line.startswith("0 is Embedding(max_norm=1.0)") and "max_norm=None" in line, line
        assert "dp.gathered_parameters(writeback=True)" in line and "\n" not in line
    assert run_workers(_embedding, 1, shard, timeout_s=60) == ["prepared"]
