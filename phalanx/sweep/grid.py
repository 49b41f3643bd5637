"""What a sweep trains: its validated config, the learning-rate rules, and the grid of points.

The chapter's exercises 1 and 2 as a grid: device counts k × per-device batches b (the global
batch is k·b, as when each added GPU brings its own b) × learning-rate rules. A rule is a fixed
number, or `scaled`: the linear-scaling rule of Goyal et al. (2017, "Accurate, Large Minibatch
SGD", section 2.1), lr = base_lr × global_batch / base_batch, with their gradual warmup for the
points whose lr it raises above base_lr (a smaller lr needs no warmup: it is already stable).
Each point is exactly a `phalanx train` run, so a `SweepConfig` validates what the two share
(model, data, epochs, seed, threads, timeout) by building every point's `TrainConfig`; its
flags are declared on its fields (the data's are `phalanx train`'s own `DataConfig`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from phalanx.data.config import DataConfig
from phalanx.job.config import TrainConfig
from phalanx.job.optim import OptimizerConfig
from phalanx.models import MODELS
from phalanx.options import Rule, at_least, device_count, check_options, component, finite, option, positive, wait_seconds
from phalanx.runtime.launch_config import LaunchConfig

SCALED = "scaled"


def parse_lr_rule(text: str) -> float | str:
    """'0.2' -> 0.2; 'scaled' -> 'scaled'; anything else is a ValueError naming the text."""
    clean = text.strip().lower()
    if clean == SCALED:
        return SCALED
    try:
        return float(clean)
    except ValueError:
        raise ValueError(f"--lr item {text!r} is neither a number nor 'scaled'; "
                         "write e.g. --lr 0.1,0.2,scaled") from None


def scaled_lr(*, base_lr: float, base_batch: int, global_batch_size: int) -> float:
    """The linear-scaling rule: the lr grows in proportion to the global batch."""
    return base_lr * global_batch_size / base_batch


@dataclass(frozen=True, kw_only=True)
class SweepConfig:
    """the grid: devices x per-device batch x lr rule, each point a `phalanx train` run"""

    # The lists' own checks (each at least 1, none repeated) are _check_list's, below.
    num_devices: tuple[int, ...] = option((1, 2, 4), flag="--devices", items=device_count, help="CPU worker counts k")
    batch_sizes_per_device: tuple[int, ...] = option((32, 128), flag="--per-device-batch", items=int,
                                                     help="batch per device b; the global batch is k*b")
    lr_rules: tuple[float | str, ...] = option((0.1, 0.2, SCALED), flag="--lr", items=parse_lr_rule,
                                               help="lr rules: numbers and/or 'scaled' = base-lr * k*b / base-batch "
                                                    "with warmup")
    # The anchor of the scaling rule: one device's run (b = 32, lr 0.1) that the rule extends to k
    # devices. The book's 0.2 at 256 scales down to 0.025 at 32 (0.68 vs 0.76 after 10 epochs of
    # the sample at 0.2).
    base_lr: float = option(0.1, check=finite(positive("finite number; use e.g. --base-lr 0.2")),
                            help="lr at the base batch for 'scaled'")
    base_batch: int = option(32, check=at_least(1, problem="must be at least 1; use e.g. --base-batch 256"),
                             help="global batch of base-lr")
    warmup_epochs: float = option(1.0, help="linear lr warmup of 'scaled' points whose lr exceeds base-lr")
    # The training settings (epochs, model, seed, threads, timeout) are TrainConfig's to judge.
    epochs: int = option(10, help="epochs per point")
    target_acc: float = option(0.7, flag="--target", help="test accuracy for time-to-target",
                               check=Rule(ok=lambda acc: 0 < acc <= 1,
                                          problem="is not an accuracy; give one in (0, 1], e.g. --target 0.7"))
    model: str = option("lenet", choices=MODELS, help="the model trained")
    data: DataConfig = component(DataConfig)
    seed: int = option(0, help="seed of each point's initial model and batch order")
    # One thread per device: k devices are k cores' worth of work, and OpenMP threads that
    # outnumber free cores spin (measured here under load: 1 device × 2 threads 8× slower).
    threads_per_device: int = option(1, help="CPU threads per worker")
    timeout_s: float = option(120.0, flag="--timeout", metavar="SECONDS", help="how long any collective may wait",
                              check=wait_seconds())
    out_dir: str = option("runs/sweep", flag="--out", metavar="DIR", help="directory for the outputs")
    resume: bool = option(False, help="reuse points already finished in --out with the same settings")
    overwrite: bool = option(False, help="replace an earlier sweep's outputs in --out")

    def __post_init__(self) -> None:
        check_options(self)
        _check_list("--devices", self.num_devices, "device counts", minimum=1)
        _check_list("--per-device-batch", self.batch_sizes_per_device, "batch sizes", minimum=1)
        if not self.lr_rules:
            raise ValueError("--lr is empty; give numbers and/or 'scaled', e.g. --lr 0.1,0.2,scaled")
        if len(set(self.lr_rules)) != len(self.lr_rules):
            raise ValueError(f"--lr {_join(self.lr_rules)} repeats a rule; name each once")
        for rule in self.lr_rules:
            if rule != SCALED and not (isinstance(rule, float) and rule > 0 and math.isfinite(rule)):
                raise ValueError(f"--lr {rule} must be a positive finite number or 'scaled'; use e.g. --lr 0.2")
        if not self.warmup_epochs >= 0:
            raise ValueError(f"--warmup-epochs {self.warmup_epochs:g} must be at least 0; use e.g. --warmup-epochs 1")
        points = expand_grid(self)
        # Only a 'scaled' point whose lr exceeds base-lr warms up: a grid without one has no warmup to fit.
        # Before train's own check of each point, which names a point's lr rather than the rule (an
        # --epochs below 1 is train's to name).
        if 1 <= self.epochs <= self.warmup_epochs and any(point.warmup_epochs for point in points):
            raise ValueError(f"--warmup-epochs {self.warmup_epochs:g} must be below --epochs {self.epochs}, so the "
                             f"scaled lr is reached; use e.g. --warmup-epochs {self.epochs / 2:g}")
        # The training settings are TrainConfig's to judge (the same one-line messages as train's).
        for point in points:
            train_config(self, point, data=self.data)

    def to_dict(self) -> dict:
        return asdict(self)


def _join(values) -> str:
    return ",".join(str(v) for v in values)


def _check_list(flag: str, values: tuple[int, ...], what: str, *, minimum: int) -> None:
    if not values:
        raise ValueError(f"{flag} is empty; give at least one of the {what}")
    if len(set(values)) != len(values):
        raise ValueError(f"{flag} {_join(values)} repeats a value; name each once")
    low = min(values)
    if low < minimum:
        raise ValueError(f"{flag} {_join(values)} holds {low}; {what} must be at least {minimum}")


@dataclass(frozen=True, kw_only=True)
class GridPoint:
    """One training of the sweep: k devices, b examples each, an lr (and its warmup)."""

    num_devices: int
    batch_size_per_device: int
    lr_rule: str  # "0.2" or "scaled": the series this point belongs to in the table and plot
    lr: float
    warmup_epochs: float

    @property
    def global_batch_size(self) -> int:
        return self.num_devices * self.batch_size_per_device

    @property
    def key(self) -> str:
        return f"k{self.num_devices}-b{self.batch_size_per_device}-lr{self.lr_rule}"

    def to_dict(self) -> dict:
        return {**asdict(self), "global_batch_size": self.global_batch_size}


def make_point(config: SweepConfig, *, num_devices: int, batch_size_per_device: int, rule: float | str) -> GridPoint:
    global_batch = num_devices * batch_size_per_device
    if rule == SCALED:
        lr = scaled_lr(base_lr=config.base_lr, base_batch=config.base_batch, global_batch_size=global_batch)
        warmup = config.warmup_epochs if lr > config.base_lr else 0.0
        return GridPoint(num_devices=num_devices, batch_size_per_device=batch_size_per_device, lr_rule=SCALED,
                         lr=lr, warmup_epochs=warmup)
    return GridPoint(num_devices=num_devices, batch_size_per_device=batch_size_per_device, lr_rule=f"{rule:g}",
                     lr=float(rule), warmup_epochs=0.0)


def expand_grid(config: SweepConfig) -> list[GridPoint]:
    """Every (k, b, rule), ordered by k first: one launch of k workers trains all of k's points."""
    return [make_point(config, num_devices=k, batch_size_per_device=b, rule=rule)
            for k in config.num_devices for b in config.batch_sizes_per_device for rule in config.lr_rules]


def train_config(config: SweepConfig, point: GridPoint, *, data: DataConfig) -> TrainConfig:
    """The `phalanx train` run one point is (a ValueError naming the setting it cannot be)."""
    return TrainConfig(model=config.model, data=data, epochs=config.epochs,
                       global_batch_size=point.global_batch_size,
                       optim=OptimizerConfig(lr=point.lr, warmup_epochs=point.warmup_epochs), seed=config.seed,
                       launch=LaunchConfig(threads_per_device=config.threads_per_device, timeout_s=config.timeout_s),
                       progress=False)
