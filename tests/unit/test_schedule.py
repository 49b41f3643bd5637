"""The lr schedule: linear warmup into the base lr, a pure function of the global step."""

import pytest
import torch

from phalanx.data_parallel.config import DataParallelConfig
from phalanx.job.optim import OptimizerConfig
from phalanx.job.schedule import lr_at, set_lr, warmup_steps


def test_no_warmup_is_constant():
    assert [lr_at(s, base_lr=0.4, warmup=0) for s in range(3)] == [0.4, 0.4, 0.4]
    assert warmup_steps(0.0, 235) == 0


def test_warmup_climbs_linearly_then_holds():
    lrs = [lr_at(s, base_lr=0.8, warmup=4) for s in range(6)]
    assert lrs == pytest.approx([0.2, 0.4, 0.6, 0.8, 0.8, 0.8])


def test_warmup_steps_round_up_fractions_of_an_epoch():
    assert warmup_steps(0.5, 15) == 8
    assert warmup_steps(2, 15) == 30


def test_set_lr_changes_every_group():
    p, q = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([{"params": [p]}, {"params": [q], "lr": 1.0}], lr=0.1)
    set_lr(opt, 0.05)
    assert [g["lr"] for g in opt.param_groups] == [0.05, 0.05]


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_config_refuses_bad_warmup(bad):
    with pytest.raises(ValueError, match="--warmup-epochs"):
        OptimizerConfig(warmup_epochs=bad)


def test_config_refuses_unknown_grad_dtype():
    with pytest.raises(ValueError, match="--grad-dtype 'int8' is unknown; choose one of bf16, fp16"):
        DataParallelConfig(grad_dtype="int8")
