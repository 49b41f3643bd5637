"""The training job's optimizer: its options, declared once, and the one place it is built.

`OptimizerConfig` holds --lr, --warmup-epochs (the schedule itself is schedule.py's: the lr is
set before every step, so a resumed run may change it) and --momentum; `build_optimizer` makes
the job's SGD from them, for every way of splitting the work. A checkpoint's optimizer state
carries the other settings it was saved with, and loading it would put them back silently:
`check_checkpoint` refuses one saved with settings other than this run's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from phalanx.errors import UsageError
from phalanx.options import Rule, at_least, check_options, finite, option, positive


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """optimizer: SGD on the global batch's mean loss"""

    lr: float = option(0.2, help="learning rate", check=finite(positive("finite number; use e.g. --lr 0.2")))
    # Linear warmup of the lr over this many epochs (fractions allowed; 0: none), per step.
    warmup_epochs: float = option(0.0, metavar="EPOCHS", help="raise the lr linearly from lr/steps to lr over this "
                                  "many epochs; 0: none", check=finite(at_least(0, problem="must be 0 (none) or a "
                                                                                 "positive number of epochs")))
    # 0: plain SGD, exactly the book's update (torch's SGD keeps no momentum buffer then).
    momentum: float = option(0.0, help="SGD momentum; 0: plain SGD", check=Rule(
        ok=lambda m: 0 <= m < 1, problem="must be at least 0 and below 1; use e.g. --momentum 0.9"))

    def __post_init__(self) -> None:
        check_options(self)


def _settings(config: OptimizerConfig) -> dict[str, float]:
    """The optimizer's settings besides the lr, by torch's names (a flag is `--` + the name, dashed)."""
    return {"momentum": config.momentum}


def build_optimizer(parameters: Iterable[torch.nn.Parameter], config: OptimizerConfig) -> torch.optim.Optimizer:
    """The job's optimizer over `parameters` (a replica's, a split's shard, or the whole model's)."""
    return torch.optim.SGD(parameters, lr=config.lr, **_settings(config))


def check_checkpoint(saved: dict, config: OptimizerConfig, *, path: str | Path) -> None:
    """UsageError (one line) when `saved`, a checkpoint's optimizer state, was made with other settings."""
    group = saved["param_groups"][0]
    for name, value in _settings(config).items():
        if name in group and group[name] != value:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"checkpoint {path} was saved with {flag} {group[name]:g} but this run has {flag} "
                             f"{value:g}; resume with the same settings")
