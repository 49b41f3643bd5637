"""The training run's configuration: one validated, picklable dataclass the CLI maps flags onto.

Validation happens on construction and raises `ValueError` with the offending numbers; the CLI
turns that into a one-line error with exit code 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from phalanx.comm import check_choice
from phalanx.models import INITS, MODELS
from phalanx.data_parallel import DEFAULT_BUCKET_CAP_MB, GRAD_DTYPES, MEMORY_FORMATS
from phalanx.data_parallel.sync_batchnorm import BATCHNORM_POLICIES
from phalanx.model_split.splits import SCHEDULES, SPLITS, check_split

DATASETS = ("fashion-mnist", "digits", "synthetic")
DTYPES = ("float32", "float64")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    model: str = "lenet"
    dataset: str | None = None  # None: fashion-mnist, not named by the user (may fall back)
    data_dir: str | None = None
    epochs: int = 10
    global_batch_size: int = 256
    lr: float = 0.2
    # Linear warmup of the lr over this many epochs (fractions allowed; 0: none), per step.
    warmup_epochs: float = 0.0
    # auto: shm for CPU workers on one host, the backend's own (NCCL, gloo across hosts) elsewhere.
    allreduce: str = "auto"
    seed: int = 0
    init: str = "pytorch"
    out_dir: str | None = None
    eval_batch_size: int = 1024
    threads_per_device: int | None = None  # CPU workers: None = cores / local workers
    bind_cores: bool = False  # pin each local worker to its own slice of the cores (runtime/binding.py)
    timeout_s: float = 120.0  # bound on every collective
    progress: bool = True
    # float64 makes k-device vs 1-device comparisons exact to ~1e-16: in float32 the rounding
    # differences of summing a batch in another order can grow chaotically while training
    # leaves its initial plateau (measured: 2e-6 to 5e-4 after 24 steps, depending on the seed).
    dtype: str = "float32"
    # Gradient exchange: overlap each bucket's allreduce with backward (False: one synchronous
    # flat allreduce after backward). bucket_cap_mb applies with overlap only; None = one bucket.
    overlap: bool = True
    bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB
    # Exchange gradients compressed to this dtype (bf16 / fp16: half the bytes); None: as computed.
    grad_dtype: str | None = None
    # Micro-batches per global batch; the first N-1 accumulate under no_sync, the last syncs.
    grad_accum_steps: int = 1
    # auto: channels_last on CPU for conv nets (~1.5x faster steps), contiguous otherwise.
    memory_format: str = "auto"
    # BatchNorm models: sync = statistics of the whole global batch (k devices == 1 device);
    # local = each device its own (the chapter's per-device statistics), running stats averaged.
    batchnorm: str = "sync"
    # --trace DIR: Chrome traces per rank + rank 0's summary; the first trace_steps of each epoch.
    trace_dir: str | None = None
    trace_steps: int = 20
    # Checkpoints: None (off), "epoch", or a number of steps as text ("50"). The directory
    # defaults to <out>/checkpoints. resume: a checkpoint dir/file, or "auto" (the checkpoint dir's
    # checkpoint when there is one - what a torchrun restart uses).
    checkpoint_every: str | None = None
    checkpoint_dir: str | None = None
    resume: str | None = None
    # An --out (or checkpoint dir) holding an earlier run's outputs is refused unless the run
    # continues it (resume) or replaces them (overwrite: they are deleted once the lock is held).
    overwrite: bool = False
    # Restart the worker set from the last checkpoint after a worker fails, up to this many
    # times; elastic: go on without a device whose worker fails again before any progress.
    max_restarts: int = 0
    elastic: bool = False
    # Every check_every steps: replicas compared bitwise, gradients checked finite (0: never).
    check_every: int = 100
    # How the work is spread (issue 13): data (replicas), layers (a pipeline of stages, cut into
    # micro_batches per step; None: 2k), channels (every layer's output channels split).
    split: str = "data"
    micro_batches: int | None = None
    schedule: str = "gpipe"  # layers: gpipe or 1f1b

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"--model {self.model!r} is unknown; choose one of {', '.join(MODELS)}")
        if self.dataset is not None and self.dataset not in DATASETS:
            raise ValueError(f"--dataset {self.dataset!r} is unknown; choose one of {', '.join(DATASETS)}")
        check_choice(self.allreduce, flag="--allreduce")
        if self.init not in INITS:
            raise ValueError(f"--init {self.init!r} is unknown; choose one of {', '.join(INITS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is unknown; choose one of {', '.join(DTYPES)}")
        if self.seed < 0:  # the epoch permutations are seeded from (seed, epoch), which must be >= 0
            raise ValueError(f"--seed {self.seed} must be 0 or more; use e.g. --seed 0")
        if self.epochs < 1:
            raise ValueError(f"--epochs {self.epochs} must be at least 1")
        if self.global_batch_size < 1:
            raise ValueError(f"--batch-size {self.global_batch_size} must be at least 1")
        if not (self.lr > 0 and math.isfinite(self.lr)):  # also rejects NaN and inf
            raise ValueError(f"--lr {self.lr} must be a positive finite number; use e.g. --lr 0.2")
        if not (self.warmup_epochs >= 0 and math.isfinite(self.warmup_epochs)):
            raise ValueError(f"--warmup-epochs {self.warmup_epochs} must be 0 (none) or a positive number of epochs")
        if self.eval_batch_size < 1:
            raise ValueError(f"eval batch size {self.eval_batch_size} must be at least 1")
        if self.threads_per_device is not None and self.threads_per_device < 1:
            raise ValueError(f"--threads-per-device {self.threads_per_device} must be at least 1")
        if self.bucket_cap_mb is not None and not self.bucket_cap_mb > 0:
            raise ValueError(f"--bucket-cap-mb {self.bucket_cap_mb} must be a positive number of MB")
        if self.grad_dtype is not None and self.grad_dtype not in GRAD_DTYPES:
            raise ValueError(f"--grad-dtype {self.grad_dtype!r} is unknown; choose one of {', '.join(GRAD_DTYPES)}")
        if self.grad_accum_steps < 1:
            raise ValueError(f"--grad-accum {self.grad_accum_steps} must be at least 1")
        if self.memory_format not in MEMORY_FORMATS:
            raise ValueError(f"--memory-format {self.memory_format!r} is unknown; choose one of {', '.join(MEMORY_FORMATS)}")
        if self.batchnorm not in BATCHNORM_POLICIES:
            raise ValueError(f"--batchnorm {self.batchnorm!r} is unknown; choose one of {', '.join(BATCHNORM_POLICIES)}")
        if self.trace_steps < 1:
            raise ValueError(f"--trace-steps {self.trace_steps} must be at least 1")
        if self.checkpoint_every is not None and self.checkpoint_every != "epoch":
            if not self.checkpoint_every.isdigit() or int(self.checkpoint_every) < 1:
                raise ValueError(f"--checkpoint-every {self.checkpoint_every} is neither 'epoch' nor a positive number "
                                 "of steps; use e.g. --checkpoint-every 50")
        if self.checkpoint_every is not None and self.checkpoint_location is None:
            raise ValueError("--checkpoint-every needs somewhere to write; add --checkpoint-dir DIR or --out DIR")
        if self.overwrite and self.resume is not None:
            raise ValueError(f"--overwrite starts afresh and --resume {self.resume} continues; pass one of them")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts {self.max_restarts} must be 0 (no restarts) or more")
        if self.max_restarts and self.checkpoint_every is None:
            raise ValueError(f"--max-restarts {self.max_restarts} restarts from the last checkpoint; "
                             "add --checkpoint-every N (or epoch)")
        if self.elastic and not self.max_restarts:
            raise ValueError("--elastic goes on without a device that fails again after a restart; "
                             "add --max-restarts N")
        if self.resume == "auto" and self.checkpoint_location is None:
            raise ValueError("--resume auto looks in the checkpoint dir; add --checkpoint-dir DIR or --out DIR")
        if self.check_every < 0:
            raise ValueError(f"--check-every {self.check_every} must be 0 (off) or a number of steps")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout {self.timeout_s} must be a positive number of seconds")
        self._check_split()

    def _check_split(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"--split {self.split!r} is unknown; choose one of {', '.join(SPLITS)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule {self.schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}")
        if self.micro_batches is not None and not 1 <= self.micro_batches <= self.global_batch_size:
            raise ValueError(f"--micro-batches {self.micro_batches} must be between 1 and the global batch "
                             f"({self.global_batch_size}); use e.g. --micro-batches 4")
        if self.split != "data":
            for flag, value, default in (("--grad-accum", self.grad_accum_steps, 1), ("--grad-dtype", self.grad_dtype, None),
                                         ("--trace", self.trace_dir, None)):
                if value != default:
                    raise ValueError(f"{flag} is a data-parallel option; drop it with --split {self.split}")

    @property
    def checkpoint_location(self) -> str | None:
        if self.checkpoint_dir is not None:
            return self.checkpoint_dir
        return None if self.out_dir is None else f"{self.out_dir}/checkpoints"

    @property
    def checkpoint_steps(self) -> int | None:
        """Steps between checkpoints, or None (only at epoch ends, or never)."""
        return int(self.checkpoint_every) if self.checkpoint_every not in (None, "epoch") else None

    def check_devices(self, num_devices: int) -> None:
        """Every device needs at least one example of each global batch."""
        if self.global_batch_size < num_devices:
            raise ValueError(
                f"--batch-size {self.global_batch_size} is smaller than the {num_devices} devices; "
                f"use --batch-size {num_devices} or more, or fewer devices"
            )
        check_split(self.split, model=self.model, num_devices=num_devices, micro_batches=self.micro_batches,
                    global_batch_size=self.global_batch_size)
