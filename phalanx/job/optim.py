"""The training job's optimizer: its options, declared once, and the one place it is built.

`OptimizerConfig` holds --optimizer (the book's plain SGD by default; Adam and AdamW, whose state
is what sharding divides), --lr (0.2 for SGD as in the book, 0.001 for Adam and AdamW unless
given), --warmup-epochs (the schedule itself is schedule.py's: the lr is set before every step,
so a resumed run may change it), --momentum, --weight-decay and --clip-grad-norm;
`build_optimizer` makes the job's optimizer through its strategy (a replica's `dp.optimizer`,
sharded or not; a model split's over its own parameters). A checkpoint's optimizer state
carries the settings it was saved with, and loading it would put them back silently:
`check_checkpoint` refuses one saved with other settings than this run's (and the checkpoint's
fingerprint one saved with another optimizer).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from phalanx.errors import UsageError
from phalanx.options import Rule, at_least, check_options, finite, option, positive

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
DEFAULT_LR = {"sgd": 0.2, "adam": 0.001, "adamw": 0.001}  # the book's SGD rate; Adam's paper's


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """optimizer: the update on the global batch's mean loss"""

    optimizer: str = option("sgd", choices=tuple(OPTIMIZERS), help="the update rule (sgd: the book's)")
    lr: float | None = option(None, default_text="0.2 for sgd, 0.001 for adam and adamw", help="learning rate",
                              check=finite(positive("finite number; use e.g. --lr 0.2")))
    # Linear warmup of the lr over this many epochs (fractions allowed; 0: none), per step.
    warmup_epochs: float = option(0.0, metavar="EPOCHS", help="raise the lr linearly from lr/W to lr over the first W "
                                  "steps, W = this many epochs of steps; 0: none", check=finite(at_least(0, problem="must be 0 (none) or a "
                                                                                 "positive number of epochs")))
    # 0: plain SGD, exactly the book's update (torch's SGD keeps no momentum buffer then).
    momentum: float = option(0.0, help="SGD momentum; 0: plain SGD", check=Rule(
        ok=lambda m: 0 <= m < 1, problem="must be at least 0 and below 1; use e.g. --momentum 0.9"))
    weight_decay: float = option(0.0, help="weight decay (L2 for sgd and adam, decoupled for adamw); 0: none",
                                 check=finite(at_least(0, problem="must be 0 (none) or more; use e.g. "
                                                                  "--weight-decay 0.01")))
    # By the summed gradient's global norm (data_parallel/clip.py), after the exchange.
    clip_grad_norm: float | None = option(None, metavar="MAX", default_text="no clipping",
                                          help="scale the gradient so its global L2 norm is at most MAX",
                                          check=finite(positive("finite number; use e.g. --clip-grad-norm 1.0")))

    def __post_init__(self) -> None:
        check_options(self)
        if self.optimizer != "sgd" and self.momentum:
            raise ValueError(f"--momentum is SGD's; --optimizer {self.optimizer} has its own moments (drop --momentum)")
        if self.lr is None:  # the default depends on the rule: the book's 0.2 makes Adam diverge
            object.__setattr__(self, "lr", DEFAULT_LR[self.optimizer])


def describe(config: OptimizerConfig) -> str:
    """The optimizer as the run's first line names it: "sgd, lr 0.2" ... "adamw, lr 0.001, weight decay 0.01"."""
    parts = [config.optimizer, f"lr {config.lr:g}"]
    if config.momentum:
        parts.append(f"momentum {config.momentum:g}")
    if config.weight_decay:
        parts.append(f"weight decay {config.weight_decay:g}")
    if config.clip_grad_norm is not None:
        parts.append(f"gradient norm clipped at {config.clip_grad_norm:g}")
    return ", ".join(parts)


def _settings(config: OptimizerConfig) -> dict[str, float]:
    """The optimizer's settings besides the lr, by torch's names (a flag is `--` + the name, dashed)."""
    found = {"weight_decay": config.weight_decay}
    if config.optimizer == "sgd":
        found["momentum"] = config.momentum
    return found


def build_optimizer(strategy, config: OptimizerConfig) -> torch.optim.Optimizer:
    """The job's optimizer for `strategy` (train/loop.py's Strategy): over a replica's share
    (`dp.optimizer`, sharded or not), or a model split's own parameters."""
    return strategy.make_optimizer(OPTIMIZERS[config.optimizer], lr=config.lr, **_settings(config))


def check_checkpoint(groups: list[dict], config: OptimizerConfig, *, path: str | Path) -> None:
    """UsageError (one line) when `groups`, a checkpoint's optimizer param groups, were made with
    other settings than this run's (the optimizer itself is in the checkpoint's fingerprint)."""
    group = groups[0] if groups else {}
    for name, value in _settings(config).items():
        if name in group and group[name] != value:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"checkpoint {path} was saved with {flag} {group[name]:g} but this run has {flag} "
                             f"{value:g}; resume with the same settings")
