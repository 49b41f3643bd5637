"""The replica's options as one object: how replicas are laid out and how their gradients are exchanged.

`DataParallelConfig` is what a `DataParallel` is built with, whole: `phalanx train`'s data-parallel
flags fill one (phalanx/options.py makes the parser from its `option` fields), `prepare`'s keywords
build one (prepare.py), and a script may hand one to `DataParallel(model, world=, options=)`. It
checks itself once, on construction, and nothing downstream checks a value again: a bad value is
one `ValueError` naming the option as its builder spells it - the flag (`--shard 'x' is unknown`),
or, re-worded by prepare, its keyword (`shard 'x' is unknown`). The fields without a flag are the
API's (mixed precision, DDP's mean, the finite check's interval, a first bucket's cap, exchanging
on one device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from phalanx.comm import CHOICES
from phalanx.data_parallel.guards.finite import DEFAULT_CHECK_FINITE_EVERY
from phalanx.data_parallel.memory_format import MEMORY_FORMATS
from phalanx.data_parallel.sharding.stages import SHARD_STAGES
from phalanx.data_parallel.sync_batchnorm import BATCHNORM_POLICIES
from phalanx.options import OptionError, Rule, at_least, check_options, option
from phalanx.runtime.horovod_deepspeed import ZERO_STAGE_NAMES, ZERO_STAGES
from phalanx.runtime.binding import available_cores, leaves_core_for_comm, workers_sharing_cores

# bucket_cap_mb "auto" (the default) is a cap per allreduce, this table's, read in one place
# (bucket_cap_for); a cap the user gives always wins. shm's, which the other algorithms keep:
# LeNet's gradient is 504 KB; 0.25 MB cuts it into 3 buckets (5.5 KB fc2 + fc1.bias, 400 KB
# fc1.weight, 99 KB conv1-2). Measured on the shared 2-core CPU box (2 gloo processes, global
# batch 256, 40 interleaved rounds in one process tree): the wait left in finish_gradient_sync
# falls from 4.8 ms (synchronous, flat) to 3.9 / 2.5 / 1.8 / 1.3 ms with 1 / 2 / 3 / 5
# overlapped buckets, while step time stays within noise for all (p10 62.8-63.8 ms) - presumably
# because on two busy cores the communication's CPU time comes out of backward's. 3 is the
# fewest buckets that hide most of the wait. native (the backend's own: gloo, NCCL): DDP's 25 MB
# (first bucket min(cap, 1 MiB), buckets.py). Every backend call pays a fixed cost (~1 ms on
# loopback gloo), so 0.25 MB - which puts each of a 30-layer 256-wide MLP's 60 tensors in a
# bucket of its own - ran its step 2.1x as long as 25 MB (95 against 49 ms, 2 workers x 1
# thread, 12 interleaved rounds); 1, 4, 25 MB and one bucket were within noise of each other
# (43-49 ms), as were all caps on LeNet (58-67 ms). DDP's paper (Li et al., VLDB 2020, its
# bucket-size experiments on NCCL and gloo) shows the same: tiny buckets pay per-call latency.
BUCKET_CAP_MB_BY_ALGORITHM = {"native": 25.0}
DEFAULT_BUCKET_CAP_MB = 0.25  # every other allreduce's
# --grad-dtype names: the dtypes a bucket may be exchanged in (None: the gradients' own).
GRAD_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Mixed precision by name (Lightning Fabric's): the autocast dtype of forward. Only bfloat16: it
# needs no loss scaling (float16's narrow exponent would need a GradScaler).
PRECISIONS = {"bf16-mixed": torch.bfloat16}
# Fabric's other precision names (and Accelerate's mixed_precision values), each named with phalanx's way:
# "true" precisions are a cast (prepare's dtype=), float16 autocast needs a GradScaler.
_WHOLE = "the model in {dtype} throughout: in phalanx, dtype={dtype!r} with precision unset (prepare casts the model)"
_FP16 = ("float16 autocast, which needs loss scaling that prepare does not do: use precision='bf16-mixed', or "
         "torch.autocast('cpu'|'cuda', dtype=torch.float16) and torch.amp.GradScaler in the script, as on one device")
FOREIGN_PRECISIONS = {
    "32-true": _WHOLE.format(dtype="float32"), "32": _WHOLE.format(dtype="float32"),
    "no": _WHOLE.format(dtype="float32"), "64-true": _WHOLE.format(dtype="float64"),
    "64": _WHOLE.format(dtype="float64"), "bf16-true": _WHOLE.format(dtype="bfloat16"),
    "16-true": _WHOLE.format(dtype="float16"), "16-mixed": _FP16, "16": _FP16, "fp16": _FP16,
    "bf16": "bfloat16 autocast, which is precision='bf16-mixed' here (Fabric's full name)",
}


def _zero_stage(shard: Any) -> int | None:
    """The ZeRO stage a `shard` value spells by number (2, "2", "zero2", "stage2"), or None."""
    if isinstance(shard, bool) or not isinstance(shard, (int, str)):
        return None
    text = str(shard).strip().lower().replace("-", "").replace("_", "").replace(" ", "")
    for prefix in ("zero", "stage"):
        text = text.removeprefix(prefix)
    return int(text) if text in ("0", "1", "2", "3") else None


def bucket_cap_for(bucket_cap_mb: float | str | None, *, algorithm: str) -> float | None:
    """The cap in MB (None: one bucket) that `bucket_cap_mb` means for buckets `algorithm` carries:
    "auto" is the table's figure for it, anything else is the caller's own."""
    if bucket_cap_mb != "auto":
        return bucket_cap_mb
    return BUCKET_CAP_MB_BY_ALGORITHM.get(algorithm, DEFAULT_BUCKET_CAP_MB)


def bucket_cap(text: str) -> float | str | None:
    """--bucket-cap-mb's text: a number of MB, 'none' (one bucket) or 'auto' (by the allreduce)."""
    if text.lower() in ("none", "auto"):
        return None if text.lower() == "none" else "auto"
    return float(text)  # argparse turns a ValueError into a one-line usage error


bucket_cap.__name__ = "MB (or 'auto' or 'none')"  # what argparse names in "invalid ... value"
_CAP_RULE = Rule(ok=lambda cap: cap == "auto" or (isinstance(cap, (int, float)) and not isinstance(cap, bool)
                                                  and math.isfinite(cap) and cap > 0),
                 problem="must be a positive number of MB, 'auto', or none (one bucket)")


def bucket_cap_mb_option() -> Any:
    """--bucket-cap-mb, declared once for the configs that take it (this one, predict's)."""
    return option("auto", parse=bucket_cap, metavar="MB", check=_CAP_RULE,
                  default_text=f"auto: {BUCKET_CAP_MB_BY_ALGORITHM['native']:g} for native, "
                               f"{DEFAULT_BUCKET_CAP_MB:g} for the others",
                  help="gradient bucket cap in MB with overlap, 'auto' by the allreduce, or 'none' for one bucket")


@dataclass(frozen=True, kw_only=True)
class DataParallelConfig:
    """data parallelism: the replicas and the gradient exchange"""

    # auto: shm for CPU workers on one host, hierarchical for CPU workers on several hosts of
    # several workers, the backend's own (NCCL, gloo) elsewhere.
    allreduce: str = option("auto", choices=CHOICES, help="allreduce algorithm (auto: shm for CPU workers on one "
                            "host, hierarchical across hosts of several workers, else native)")
    # True: each bucket's exchange launched as backward fills it, run beside backward (on a thread of
    # its own unless native); False: one synchronous exchange after backward, on the training
    # thread; None (auto): False where that thread would find no free core (resolve_overlap).
    overlap: bool | None = option(None, default_text="auto: off for the shm allreduce when the workers' threads fill "
                                  "the cores", help="exchange gradients beside backward, bucket by bucket "
                                  "(--overlap), or after it on the training thread (--no-overlap)")
    bucket_cap_mb: float | str | None = bucket_cap_mb_option()  # auto: bucket_cap_for the allreduce
    grad_dtype: str | None = option(None, choices=tuple(GRAD_DTYPES), default_text="as computed",
                                    help="exchange gradients compressed to this dtype (half the bytes)")
    # Micro-batches per global batch; the first N-1 accumulate under no_sync, the last syncs (DataSplit's).
    grad_accum_steps: int = option(1, flag="--grad-accum", check=at_least(1),
                                   help="micro-batches per global batch; gradients are exchanged once per batch")
    memory_format: str = option("auto", choices=MEMORY_FORMATS,
                                help="activation layout (auto: channels_last for conv nets on CPU, ~1.5x faster steps)")
    # sync = statistics of the whole global batch (k devices == 1 device); local = each device its
    # own (the chapter's per-device statistics), running stats averaged.
    batchnorm: str = option("sync", choices=BATCHNORM_POLICIES, help="BatchNorm models' statistics (sync: "
                            "whole-batch, k devices == 1 device; local: per-device)")
    # ZeRO stages 1-3 (sharding/): what each rank keeps only 1/k of.
    shard: str = option("none", choices=SHARD_STAGES, help="keep 1/k per device of the optimizer state (optimizer), "
                        "also the gradients (gradients), also the parameters (parameters)")
    # The API's options (no flag).
    first_bucket_cap_mb: float | None = None  # None: DDP's rule, min(cap, 1 MiB)
    precision: str | None = None  # "bf16-mixed": forward under torch.autocast; None: the dtype throughout
    # None: sums, and expects shard_loss (named at the first step if not); True: DDP's mean of
    # per-rank means; False: sums and checks nothing.
    average: bool | None = None
    average_running_stats: bool = True  # plain BatchNorm's running statistics averaged after each synced step
    check_finite_every: int = DEFAULT_CHECK_FINITE_EVERY  # synced steps between NaN/Inf and replica checks (0: off)
    # A world of one builds its buckets, hooks and exchange all the same (its collectives return at
    # once): the step each of k devices runs, to profile it or to capture it with static buffers.
    exchange_alone: bool = False

    def __post_init__(self) -> None:
        stage = _zero_stage(self.shard)
        if stage is not None:  # one spelling per setting: the names say what each rank keeps 1/k of
            raise OptionError(f"{{shard}} {self.shard!r} is ZeRO's stage {stage}, which phalanx names "
                              f"{ZERO_STAGES[stage]!r} ({ZERO_STAGE_NAMES}: what each rank keeps 1/k of)", config=self)
        check_options(self)
        if self.shard != "none" and self.allreduce in ("naive", "tree"):
            raise OptionError(f"{{shard}} {self.shard} reduce-scatters and all-gathers, which {{allreduce}} "
                              f"{self.allreduce} cannot; use {{allreduce}} auto, shm, hierarchical, ring or native",
                              config=self)
        if self.first_bucket_cap_mb is not None and not self.first_bucket_cap_mb > 0:
            raise ValueError(f"first_bucket_cap_mb must be a positive number of MB (or None), "
                             f"got {self.first_bucket_cap_mb}")
        if str(self.precision) in FOREIGN_PRECISIONS:  # Fabric's precision=16 is an int
            raise ValueError(f"precision {self.precision!r} is {FOREIGN_PRECISIONS[str(self.precision)]}")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r} is unknown; choose one of {', '.join(PRECISIONS)} "
                             "(or None)")
        if self.average not in (None, True, False):
            raise ValueError(f"average must be None, True or False, got {self.average!r}")
        every = self.check_finite_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"check_finite_every must be 0 (off) or a number of steps, got {every!r}")

    @property
    def wire_dtype(self) -> torch.dtype | None:
        """The dtype each bucket is exchanged in (None: the gradients' own)."""
        return None if self.grad_dtype is None else GRAD_DTYPES[self.grad_dtype]

    @property
    def forward_dtype(self) -> torch.dtype | None:
        """The dtype forward runs in under `precision` (None: no autocast)."""
        return PRECISIONS.get(self.precision)


def resolve_overlap(overlap: bool | None, *, algorithm: str, local_workers: int) -> tuple[bool, str | None]:
    """Whether a replica's exchange overlaps backward (`overlap`: True, False, or None for auto),
    and what auto saw (None where it was given): `auto_overlap` for this process's cores, threads
    and the workers sharing them."""
    if overlap is not None:
        return overlap, None
    sharing = workers_sharing_cores(local_workers)
    return auto_overlap(algorithm=algorithm, workers=sharing, threads=torch.get_num_threads(), cores=available_cores(),
                        bound_among=local_workers if sharing < local_workers else None)


def auto_overlap(*, algorithm: str, workers: int, threads: int, cores: int,
                 bound_among: int | None = None) -> tuple[bool, str | None]:
    """overlap auto for `workers` processes of `threads` threads on `cores` cores, and why.

    Off for the shm allreduce when no core is left for the communication thread
    (binding.leaves_core_for_comm). The shm sums and copies are CPU work on the training cores
    either way; a thread beside backward only takes a core from it and adds a hand-off and two
    wake-ups per bucket, and its buckets make the ranks meet several times a step. Side by side on
    2 workers x 1 thread (2 cores), one exchange on the training thread after backward ran LeNet's
    step 2-8% faster than the threaded overlap and an MLP's 4% (docs/benchmarks.md). On otherwise:
    the backend's own async ops (NCCL on a GPU) and the network algorithms' waits cost the cores
    nothing while they hide the wire's time. `phalanx predict` asks the same rule for each k.
    `bound_among`: this process is one of that many workers, each bound to its own `cores`
    (--bind-cores), which the reason says instead of "1 worker"."""
    if algorithm != "shm":
        return True, None
    on = f"{threads} thread{'s' * (threads > 1)} on {cores} core{'s' * (cores > 1)}"
    if bound_among is not None:
        layout, verb, per = f"each of {bound_among} workers, bound to its own share, with {on},", "leaves", ""
    else:
        layout = f"{workers} worker{'s' * (workers > 1)} x {on}"
        verb, per = ("leave", " per worker") if workers > 1 else ("leaves", "")
    if leaves_core_for_comm(cores=cores, workers=workers, threads=threads):
        return True, f"{layout} {verb} a core{per} for a communication thread"
    return False, f"{layout} {verb} no core for a communication thread"
