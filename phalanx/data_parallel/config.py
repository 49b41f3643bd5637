"""The data-parallel options of a training run: how replicas are laid out and how gradients are exchanged.

`DataParallelConfig` declares each flag once (phalanx/options.py makes the parser from it): the
allreduce algorithm, overlap and its bucket cap, compression, accumulation, the memory format,
the BatchNorm policy and sharding. `prepare` (prepare.py) and `DataSplit` (strategy.py) take them as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from phalanx.comm import CHOICES
from phalanx.data_parallel.data_parallel import DEFAULT_BUCKET_CAP_MB, GRAD_DTYPES
from phalanx.data_parallel.memory_format import MEMORY_FORMATS
from phalanx.data_parallel.sharded import SHARD_STAGES
from phalanx.data_parallel.sync_batchnorm import BATCHNORM_POLICIES
from phalanx.options import at_least, check_options, finite, option, positive


def bucket_cap(text: str) -> float | None:
    """--bucket-cap-mb's text: a number of MB, or 'none' (one bucket)."""
    if text.lower() == "none":
        return None
    return float(text)  # argparse turns a ValueError into a one-line usage error


bucket_cap.__name__ = "MB (or 'none')"  # what argparse names in "invalid ... value"


def bucket_cap_mb_option() -> Any:
    """--bucket-cap-mb, declared once for the configs that take it (this one, predict's)."""
    return option(DEFAULT_BUCKET_CAP_MB, parse=bucket_cap, metavar="MB", check=finite(positive("number of MB")),
                  help="gradient bucket cap in MB with overlap, or 'none' for one bucket")


@dataclass(frozen=True, kw_only=True)
class DataParallelConfig:
    """data parallelism: the replicas and the gradient exchange"""

    # auto: shm for CPU workers on one host, hierarchical for CPU workers on several hosts of
    # several workers, the backend's own (NCCL, gloo) elsewhere.
    allreduce: str = option("auto", choices=CHOICES, help="allreduce algorithm (auto: shm for CPU workers on one "
                            "host, hierarchical across hosts of several workers, else native)")
    # Overlap each bucket's allreduce with backward (False: one synchronous flat allreduce after
    # backward). bucket_cap_mb applies with overlap only; None = one bucket.
    overlap: bool = option(True, flag="--no-overlap", help="exchange gradients in one synchronous allreduce after "
                           "backward (default: bucketed allreduces overlapped with backward)")
    bucket_cap_mb: float | None = bucket_cap_mb_option()
    grad_dtype: str | None = option(None, choices=tuple(GRAD_DTYPES), default_text="as computed",
                                    help="exchange gradients compressed to this dtype (half the bytes)")
    # Micro-batches per global batch; the first N-1 accumulate under no_sync, the last syncs.
    grad_accum_steps: int = option(1, flag="--grad-accum", check=at_least(1),
                                   help="micro-batches per global batch; gradients are exchanged once per batch")
    memory_format: str = option("auto", choices=MEMORY_FORMATS,
                                help="activation layout (auto: channels_last for conv nets on CPU, ~1.5x faster steps)")
    # sync = statistics of the whole global batch (k devices == 1 device); local = each device its
    # own (the chapter's per-device statistics), running stats averaged.
    batchnorm: str = option("sync", choices=BATCHNORM_POLICIES, help="BatchNorm models' statistics (sync: "
                            "whole-batch, k devices == 1 device; local: per-device)")
    # ZeRO stages 1-3 (sharded.py): what each rank keeps only 1/k of.
    shard: str = option("none", choices=SHARD_STAGES, help="keep 1/k per device of the optimizer state (optimizer), "
                        "also the gradients (gradients), also the parameters (parameters)")

    def __post_init__(self) -> None:
        check_options(self)
        if self.shard != "none" and self.allreduce in ("naive", "tree"):
            raise ValueError(f"--shard {self.shard} reduce-scatters and all-gathers, which --allreduce {self.allreduce} "
                             "cannot; use --allreduce auto, shm, hierarchical, ring or native")
