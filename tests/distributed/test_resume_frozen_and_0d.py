"""A checkpoint of a model with a 0-d parameter and frozen parameters resumes across shardings exactly.

A learnable temperature (a 0-d parameter), a frozen layer (requires_grad=False, in a param group
of its own) and a frozen weight inside a trained group: 3 steps, `phalanx.checkpoint`, a new
replica with another `shard=` whose frozen layer was built otherwise (as a script that loads its
pretrained weights after resuming would have it), `phalanx.resume`, 3 more steps, against 6
uninterrupted steps, 2 workers, float64. A whole checkpoint's 0-d moments have the shape of the
0-d `step`; they must land in the 1-element piece as per-element state. A sharded checkpoint must
hold the frozen weights (every rank has them whole), so a whole model read from it is the saved
one, and a plain optimizer's groups, which keep frozen parameters, load; one written before they
were kept is one line naming them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import phalanx
from tests.distributed.resumed import resumed_relative_error, whole_state

pytestmark = pytest.mark.distributed

STEPS, SAVED_AT, ROWS = 6, 3, 10
OPTIMIZERS = {"adamw": (torch.optim.AdamW, {"lr": 1e-2}), "adagrad": (torch.optim.Adagrad, {"lr": 5e-2}),
              "nesterov": (torch.optim.SGD, {"lr": 5e-2, "momentum": 0.9, "nesterov": True})}


class Tempered(nn.Module):
    def __init__(self, zero_d: bool) -> None:
        super().__init__()
        self.lin1 = nn.Linear(5, 4)
        self.frozen = nn.Linear(4, 4)
        self.lin2 = nn.Linear(4, 2)
        self.temperature = nn.Parameter(torch.tensor(1.3) if zero_d else torch.tensor([1.3]))
        self.frozen.requires_grad_(False)
        self.lin2.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.frozen(torch.tanh(self.lin1(x)))) * self.temperature


def _replica(world, shard: str, optimizer: str, zero_d: bool, frozen_seed: int):
    torch.manual_seed(0)
    model = Tempered(zero_d)
    torch.manual_seed(frozen_seed)
    with torch.no_grad():
        model.frozen.weight.copy_(torch.randn(4, 4))  # the saving run's, or another the resumed run must not keep
    dp = phalanx.prepare(model, world=world, shard=shard)
    m = dp.module
    groups = [{"params": [m.lin1.weight, m.lin2.weight]},
              {"params": [m.temperature, m.lin1.bias, m.lin2.bias], "lr": 2e-2},
              {"params": list(m.frozen.parameters())}]
    cls, defaults = OPTIMIZERS[optimizer]
    return dp, (dp.optimizer(cls, groups, **defaults) if shard != "none" else cls(groups, **defaults))


def _steps(world, dp, optimizer, first: int, last: int) -> None:
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(STEPS, ROWS, 5, generator=g), torch.randn(STEPS, ROWS, 2, generator=g)
    mine = phalanx.rank_shard(torch.arange(ROWS), rank=world.rank, world_size=world.world_size)
    for step in range(first, last):
        optimizer.zero_grad()
        phalanx.shard_loss(((dp(x[step][mine]) - y[step][mine]) ** 2).sum(), ROWS).backward()
        dp.finish_gradient_sync()
        optimizer.step()


def _uninterrupted_and_resumed(directory: str, saved_with: str, resumed_with: str, optimizer_name: str,
                               zero_d: bool, forget_frozen: bool) -> tuple[float, str | None]:
    torch.set_default_dtype(torch.float64)
    world = phalanx.init()
    dp, optimizer = _replica(world, "none", optimizer_name, zero_d, frozen_seed=1)
    _steps(world, dp, optimizer, 0, STEPS)
    reference = whole_state(dp)
    dp.close()

    dp, optimizer = _replica(world, saved_with, optimizer_name, zero_d, frozen_seed=1)
    _steps(world, dp, optimizer, 0, SAVED_AT)
    where = Path(directory) / "checkpoints"
    phalanx.checkpoint(where, world=world, model=dp, optimizer=optimizer, epoch=0, step=SAVED_AT,
                       global_batch_size=ROWS, seed=0)
    dp.close()
    if forget_frozen and world.is_main:  # as a sharded checkpoint saved before the frozen weights were kept
        state = torch.load(where / "checkpoint.pt", weights_only=True)
        state["model"] = {k: v for k, v in state["model"].items() if not k.startswith("frozen.")}
        torch.save(state, where / "checkpoint.pt")
    phalanx.barrier(world=world)

    resumed = lambda: _replica(world, resumed_with, optimizer_name, zero_d, frozen_seed=2)  # noqa: E731
    return resumed_relative_error(world, where, resumed,
                                  lambda dp, optimizer: _steps(world, dp, optimizer, SAVED_AT, STEPS), reference,
                                  saved_at=SAVED_AT, global_batch_size=ROWS)


@pytest.mark.parametrize("saved_with, resumed_with, optimizer, zero_d", [
    ("none", "gradients", "adamw", True),  # a whole checkpoint's 0-d moments into a 1-element piece
    ("none", "optimizer", "nesterov", True),
    ("optimizer", "none", "adagrad", True),  # and back: frozen weights and a plain optimizer's groups
    ("gradients", "optimizer", "adamw", True),
    ("parameters", "none", "adamw", False),
])
def test_a_0d_parameter_and_frozen_weights_resume_across_shardings_as_if_uninterrupted(
        tmp_path, saved_with, resumed_with, optimizer, zero_d):
    results = phalanx.launch(_uninterrupted_and_resumed, str(tmp_path), saved_with, resumed_with, optimizer, zero_d,
                             False, devices="cpu:2", timeout_s=120, quiet=True)
    for worst, error in results:
        assert error is None, error
        assert worst <= 1e-12, f"{worst:.3g} relative from the uninterrupted run"


def test_a_sharded_checkpoint_without_its_frozen_weights_is_one_line_read_whole(tmp_path):
    results = phalanx.launch(_uninterrupted_and_resumed, str(tmp_path), "optimizer", "none", "adamw", True, True,
                             devices="cpu:2", timeout_s=120, quiet=True)
    for _, error in results:
        assert error is not None and "holds no frozen.weight, frozen.bias: frozen parameters" in error \
            and "\n" not in error, error
