"""What one `phalanx verify` comparison runs: a validated, picklable dataclass and the loss rule.

`VerifyConfig` holds everything the 1-device reference and the k-device runs share (steps, lr,
dtype, batches, exchange settings) plus the knobs the diagnosis probes turn (modules put in eval
mode, batches trimmed to split evenly) and one planted bug that cannot be expressed through the
model or the loss (`shuffle_per_rank`). `grad_dtype` compresses the exchanged gradients, so verify
measures the error compression brings (bf16 keeps 8 mantissa bits: ~4e-3 relative per element). `scale_loss` is the loss convention under test: how one
rank turns its shard's loss into the scalar it backpropagates. phalanx's own rule (`global`:
loss sum / global batch size) is exact for any split; `rank-mean` (each rank's mean, averaged
over ranks: DDP's default) is exact only when the shards are equal; `rank-sum` (the ranks' means
summed) makes the gradient about k times too large.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

import torch

from phalanx.comm import CHOICES
from phalanx.data_parallel import BATCHNORM_POLICIES, GRAD_DTYPES, MEMORY_FORMATS
from phalanx.data_parallel.step import shard_loss
from phalanx.options import Rule, at_least, device_count, check_options, finite, option, positive, wait_seconds

DTYPES = ("float32", "float64")
# Relative tolerance per tensor (compare.py: max |a - b| / max |b|, floored). float64 k-vs-1 runs
# agree to ~1e-15 (LeNet) and ~6e-11 (LeNet-BN: the bias before each BatchNorm has an exactly-zero
# gradient that holds only rounding noise), so 1e-9 leaves margin; float32 rounding (a batch summed
# as 61 or as 31 + 30) grows while the weights move: measured up to 1.4e-5 (LeNet) and 4.6e-3
# (LeNet-BN) within 5 steps, while the planted bugs differ by 2e-2 (rank-mean) to 0.4 (BatchNorm).
DEFAULT_TOLERANCE = {"float64": 1e-9, "float32": 1e-2}
LOSS_SCALES = ("global", "rank-mean", "rank-sum")
LOSS_REDUCTIONS = ("mean", "sum")
EVAL_MODULES = ("batchnorm", "dropout")
DEVICE_KINDS = ("cpu", "cuda")
# The default global batch: a prime, so it splits unevenly over every k from 2 to 60.
DEFAULT_GLOBAL_BATCH_SIZE = 61

LossScale = Union[str, Callable[..., torch.Tensor]]


@dataclass(frozen=True, kw_only=True)
class VerifyConfig:
    """the comparison: k devices against 1, step by step"""

    # k values compared with 1 device, one spawned run each
    world_sizes: tuple[int, ...] = option(
        (2, 3), flag="--devices", items=device_count, help="device counts k compared with 1 device",
        check=Rule(ok=lambda k: isinstance(k, int) and k >= 2,
                   problem="must be at least 2 (1 device is the reference every count is compared "
                           "with); e.g. --devices 2,3"))
    steps: int = option(5, check=at_least(1), help="SGD steps compared")
    # for (inputs, targets) data; ignored for a batches_fn
    global_batch_size: int = option(DEFAULT_GLOBAL_BATCH_SIZE, flag="--batch-size",
                                    help="global batch (a prime: uneven over every k)")
    lr: float = option(0.2, check=finite(positive("finite number; use e.g. --lr 0.2")),
                       help="plain SGD's learning rate, as phalanx train's")
    dtype: str = option("float64", choices=DTYPES, help="parameter dtype (float64: exact)")
    # relative, per tensor; None: DEFAULT_TOLERANCE[dtype]
    tolerance: float | None = option(None, check=finite(positive("finite number, e.g. 1e-9")),
                                     default_text=", ".join(f"{tol:g} in {dtype}"
                                                            for dtype, tol in DEFAULT_TOLERANCE.items()),
                                     help="relative difference allowed per tensor")
    algorithm: str = option("auto", flag="--allreduce", choices=CHOICES, help="the k-device runs' allreduce")
    overlap: bool | None = option(None, default_text="auto, as phalanx train's", help="the k-device runs' exchange "
                                  "beside backward (--overlap) or after it (--no-overlap)")
    bucket_cap_mb: float | str | None = "auto"  # with overlap; None: one bucket; auto: by the allreduce (prepare's)
    # the k-device runs' BatchNorm policy (the reference is plain BatchNorm)
    batchnorm: str = option("sync", choices=BATCHNORM_POLICIES, help="BatchNorm models' statistics")
    memory_format: str = "auto"  # the k-device runs' layout, as phalanx train (the reference: contiguous)
    # The k-device runs exchange gradients compressed to this dtype: a name of GRAD_DTYPES ("bf16",
    # "fp16") or the torch dtype itself (stored as its name); None: exchanged as computed.
    grad_dtype: str | torch.dtype | None = option(None, choices=tuple(GRAD_DTYPES), default_text="as computed",
                                                  help="exchange gradients compressed to this dtype and measure the "
                                                       "error")
    loss_reduction: str = "mean"  # what loss_fn returns over the examples it is given
    # How a rank scales its loss before backward: a name of LOSS_SCALES, or a picklable callable
    # (loss, *, n_local, n_global, world_size) -> tensor. The reference is the same rule at k = 1.
    loss_scale: LossScale = "global"
    seed: int = option(0, check=at_least(0, problem="must be 0 or more; use e.g. --seed 0"),
                       help="seed of the model and the batch order")
    eval_modules: tuple[str, ...] = ()  # module kinds put in eval mode in every run (probes)
    trim_to_multiple: int | None = None  # probes: cut every global batch to a multiple of this
    shuffle_per_rank: bool = False  # planted bug: each rank draws its own batch order
    device: str = option("cpu", choices=DEVICE_KINDS, help="cpu (k worker processes) or cuda (k GPUs)")
    threads_per_device: int = 1
    timeout_s: float = option(60.0, flag="--timeout", metavar="SECONDS", check=wait_seconds(),
                              help="how long any collective may wait")
    deadline_s: float | None = None  # bound on each whole spawned run (tests); None: none
    # on failure, name the culprit (may rerun with probes)
    diagnose: bool = option(True, flag="--no-diagnose", help="on failure, do not rerun probes to name a cause")

    def __post_init__(self) -> None:
        if isinstance(self.grad_dtype, torch.dtype):
            names = {dtype: name for name, dtype in GRAD_DTYPES.items()}
            if self.grad_dtype not in names:
                raise ValueError(f"grad_dtype {self.grad_dtype} is not supported; use one of {', '.join(GRAD_DTYPES)}")
            object.__setattr__(self, "grad_dtype", names[self.grad_dtype])  # frozen: normalize once
        check_options(self)
        if self.global_batch_size < max(self.world_sizes):
            raise ValueError(f"--batch-size {self.global_batch_size} is smaller than {max(self.world_sizes)} devices; "
                             f"use --batch-size {max(self.world_sizes)} or more")
        if self.bucket_cap_mb not in (None, "auto") and not self.bucket_cap_mb > 0:
            raise ValueError(f"--bucket-cap-mb {self.bucket_cap_mb} must be a positive number of MB")
        if self.memory_format not in MEMORY_FORMATS:
            raise ValueError(f"memory format {self.memory_format!r} is unknown; choose one of {', '.join(MEMORY_FORMATS)}")
        if self.loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction {self.loss_reduction!r} is unknown; choose one of {', '.join(LOSS_REDUCTIONS)}")
        if not callable(self.loss_scale) and self.loss_scale not in LOSS_SCALES:
            raise ValueError(f"loss_scale {self.loss_scale!r} is unknown; choose one of {', '.join(LOSS_SCALES)} "
                             "or pass a callable (loss, *, n_local, n_global, world_size) -> tensor")
        unknown = [m for m in self.eval_modules if m not in EVAL_MODULES]
        if unknown:
            raise ValueError(f"--eval {unknown[0]!r} is unknown; choose from {', '.join(EVAL_MODULES)}")
        if self.trim_to_multiple is not None and self.trim_to_multiple < 1:
            raise ValueError(f"trim_to_multiple {self.trim_to_multiple} must be at least 1")
        if self.threads_per_device < 1:
            raise ValueError(f"threads_per_device {self.threads_per_device} must be at least 1")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ValueError(f"deadline_s {self.deadline_s} must be positive seconds or None")

    @property
    def rtol(self) -> float:
        return self.tolerance if self.tolerance is not None else DEFAULT_TOLERANCE[self.dtype]

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def torch_grad_dtype(self) -> torch.dtype | None:
        return None if self.grad_dtype is None else GRAD_DTYPES[self.grad_dtype]

    def describe_loss_scale(self) -> str:
        return self.loss_scale if isinstance(self.loss_scale, str) else getattr(self.loss_scale, "__name__", "custom")


def scale_loss(loss: torch.Tensor, *, n_local: int, n_global: int, world_size: int, reduction: str,
               scale: LossScale) -> torch.Tensor:
    """The scalar one rank backpropagates for its shard's `loss` (what loss_fn returned).

    `global`: loss sum / global batch size; after the ranks' gradients are summed this is the
    1-device gradient of the mean loss, for any split. `rank-mean`: this rank's mean / k.
    `rank-sum`: this rank's mean, unscaled. A callable gets the raw loss and the sizes.
    """
    if callable(scale):
        return scale(loss, n_local=n_local, n_global=n_global, world_size=world_size)
    if scale == "global":
        loss_sum = loss * n_local if reduction == "mean" else loss
        return shard_loss(loss_sum, n_global)
    loss_mean = loss if reduction == "mean" else loss / n_local
    if scale == "rank-mean":
        return loss_mean / world_size
    if scale == "rank-sum":
        return loss_mean
    raise ValueError(f"loss_scale {scale!r} is unknown; choose one of {', '.join(LOSS_SCALES)}")

