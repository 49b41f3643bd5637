"""`phalanx train --momentum`: the option added in one place (job/optim.py) to prove the declaration.

At 0 (the default) the job's optimizer is exactly plain SGD, bitwise; above 0 it is torch's SGD
with that momentum; outside [0, 1) it is one line; a checkpoint saved with another momentum is
refused on resume instead of quietly bringing its own back; a split refuses it (its checkpoint
keeps no per-shard optimizer state). A job trained with it: tests/distributed/test_one_device_jobs.py.
"""

from __future__ import annotations

import pytest
import torch

from phalanx.cli import build_parser
from phalanx.errors import UsageError
from phalanx.job.config import TrainConfig
from phalanx.job.optim import OptimizerConfig, build_optimizer, check_checkpoint
from phalanx.model_split.config import SplitConfig
from phalanx.options import build


def _train(argv: list[str]) -> TrainConfig:
    return build(TrainConfig, build_parser(["train"]).parse_args(["train", *argv]))


def _steps(make_optimizer, steps: int = 4) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3).double()
    optimizer = make_optimizer(model.parameters())
    x, y = torch.randn(16, 5, dtype=torch.float64), torch.randint(0, 3, (16,))
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def test_the_flag_fills_the_optimizer_config_and_shows_its_default():
    assert _train([]).optim.momentum == 0.0
    assert _train(["--momentum", "0.9"]).optim.momentum == 0.9
    assert "SGD momentum; 0: plain SGD (default: 0.0)" in " ".join(
        build_parser(["train"])._subparsers._group_actions[0].choices["train"].format_help().split())


@pytest.mark.parametrize("bad", [1.0, -0.1, float("nan")])
def test_momentum_outside_0_to_1_is_refused_naming_the_number(bad):
    with pytest.raises(ValueError, match=rf"--momentum {bad} must be at least 0 and below 1; use e.g. --momentum 0.9"):
        OptimizerConfig(momentum=bad)


class _Over:
    """A strategy's make_optimizer over `params` (what a model split's does)."""

    def __init__(self, params) -> None:
        self.params = list(params)

    def make_optimizer(self, cls, **defaults):
        return cls(self.params, **defaults)


def test_at_0_the_optimizer_is_plain_sgd_bitwise_and_above_0_torchs_momentum():
    plain = _steps(lambda params: torch.optim.SGD(params, lr=0.1))
    for ours, reference in zip(_steps(lambda params: build_optimizer(_Over(params), OptimizerConfig(lr=0.1))), plain):
        assert torch.equal(ours, reference)
    heavy = _steps(lambda params: build_optimizer(_Over(params), OptimizerConfig(lr=0.1, momentum=0.9)))
    for ours, reference in zip(heavy, _steps(lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))):
        assert torch.equal(ours, reference)
    assert not torch.equal(heavy[0], plain[0])  # the momentum took effect


def test_a_checkpoint_saved_with_another_momentum_is_refused_in_one_line(tmp_path):
    saved = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.2).state_dict()  # today's plain SGD
    check_checkpoint(saved["param_groups"], OptimizerConfig(), path=tmp_path / "checkpoint.pt")  # the same settings
    with pytest.raises(UsageError) as info:
        check_checkpoint(saved["param_groups"], OptimizerConfig(momentum=0.9), path=tmp_path / "checkpoint.pt")
    assert str(info.value) == (f"checkpoint {tmp_path / 'checkpoint.pt'} was saved with --momentum 0 but this run "
                               "has --momentum 0.9; resume with the same settings")


def test_a_split_refuses_it():
    with pytest.raises(ValueError, match=r"--split layers trains with plain SGD \(no momentum, no clipping\); drop --momentum"):
        TrainConfig(split=SplitConfig(kind="layers"), optim=OptimizerConfig(momentum=0.5))
