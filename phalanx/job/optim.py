"""The training job's optimizer: its options, declared once, and the one place it is built.

`OptimizerConfig` holds --lr and --warmup-epochs (the schedule itself is schedule.py's: the lr
is set before every step, so a resumed run may change it); `build_optimizer` makes the job's
SGD from them, for every way of splitting the work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from phalanx.options import at_least, check_options, finite, option, positive


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """optimizer: SGD on the global batch's mean loss"""

    lr: float = option(0.2, help="learning rate", check=finite(positive("finite number; use e.g. --lr 0.2")))
    # Linear warmup of the lr over this many epochs (fractions allowed; 0: none), per step.
    warmup_epochs: float = option(0.0, metavar="EPOCHS", help="raise the lr linearly from lr/steps to lr over this "
                                  "many epochs; 0: none", check=finite(at_least(0, problem="must be 0 (none) or a "
                                                                                 "positive number of epochs")))

    def __post_init__(self) -> None:
        check_options(self)


def build_optimizer(parameters: Iterable[torch.nn.Parameter], config: OptimizerConfig) -> torch.optim.Optimizer:
    """The job's optimizer over `parameters` (a replica's, a split's shard, or the whole model's)."""
    return torch.optim.SGD(parameters, lr=config.lr)
