"""`prepare`: the one place that turns a plain nn.Module into a replica ready to train on k devices.

In the spirit of Lightning Fabric's `setup` and Accelerate's `prepare`: a user's model goes in,
a `DataParallel` comes out, with phalanx's defaults applied in this order - the dtype; BatchNorm
per policy (`sync`: SyncBatchNorm, the whole global batch's statistics, when there is more than
one device; `local`: each device its own); the memory format (`auto`: channels_last for conv nets
on CPU, memory_format.py); then `DataParallel` with its exchange (allreduce algorithm, overlap,
bucket cap, wire dtype), optionally mixed precision (`precision="bf16-mixed"`: forward under
`torch.autocast`, weights and the gradient exchange float32). `phalanx train`, verify, predict, bench and the examples all prepare
their replicas here, so a user's own script gets what the CLI gets. What was chosen is attached
to the replica as `dp.choices`; `dp.choices.describe()` says it in one line (STYLE habit 14:
the run's first log line names the transport, the bucket layout and the memory format).
A world of one with no `comm` gets the plain loop (DataParallel builds no buckets or hooks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from phalanx.comm import AsyncComm, check_choice, shm_applies
from phalanx.data_parallel.data_parallel import DEFAULT_BUCKET_CAP_MB, GRAD_DTYPES, DataParallel
from phalanx.data_parallel.memory_format import apply_memory_format, format_name, resolve_memory_format
from phalanx.data_parallel.sync_batchnorm import BATCHNORM_POLICIES, convert_sync_batchnorm
from phalanx.runtime.world import World


@dataclass(frozen=True, kw_only=True)
class Choices:
    """What `prepare` chose for one replica: the facts behind the run's first log line."""

    dtype: str  # the parameters' dtype, e.g. "float32"
    batchnorm: str  # the policy asked for: "sync" or "local"
    has_batchnorm: bool  # False: the policy had nothing to act on
    num_devices: int
    memory_format: str  # "channels_last" or "contiguous"
    requested_algorithm: str  # what was asked for ("auto" or a name)
    algorithm: str  # the allreduce that runs
    fallback_reason: str | None  # why auto fell back to native where it would have chosen shm
    exchanging: bool  # False: a world of one, the plain loop
    overlap: bool
    bucket_kb: tuple[float, ...]
    grad_dtype: str | None  # the wire dtype's name ("bf16", "fp16"), None: as computed
    precision: str | None = None  # "bf16-mixed": forward under autocast; None: the dtype throughout
    backend: str = "none"  # the world's ("gloo", "nccl"): what `native` runs
    why_not_shm: str | None = None  # why auto chose native for k > 1 (ranks span hosts, GPUs), or None

    def describe(self) -> str:
        """One line: allreduce, gradient exchange, memory format, dtype and (if any) BatchNorm."""
        mixed = f", {self.precision} (autocast forward, float32 weights and gradients)" if self.precision else ""
        return f"allreduce {self._algorithm_text()}, {self._exchange_text()}, {self.memory_format}, " \
               f"{self.dtype}{mixed}{self._batchnorm_text()}"

    def _algorithm_text(self) -> str:
        if self.requested_algorithm != "auto":
            return self.algorithm
        if self.num_devices > 1 and self.algorithm == "shm":
            return "shm (auto: CPU workers on one host share memory)"
        if self.fallback_reason is not None:
            return f"native (auto: {self.fallback_reason.split('; use')[0]})"
        if self.num_devices > 1 and self.why_not_shm is not None:  # e.g. ranks on several hosts
            return f"native = {self.backend}'s own allreduce (auto: {self.why_not_shm})"
        return f"{self.algorithm} (auto)"

    def _exchange_text(self) -> str:
        if not self.exchanging:  # one device: no buckets, hooks or thread
            return "no gradient exchange (one device)"
        sizes = ", ".join(f"{kb:.1f}" for kb in self.bucket_kb)
        wire = f" sent as {self.grad_dtype}" if self.grad_dtype else ""
        mode = "overlapped" if self.overlap else "synchronous"
        return f"{mode} gradient exchange in {len(self.bucket_kb)} bucket(s) of [{sizes}] KB{wire}"

    def _batchnorm_text(self) -> str:
        if not self.has_batchnorm:
            return ""
        if self.num_devices == 1:
            return f", BatchNorm {self.batchnorm} (one device: plain BatchNorm sees the whole batch)"
        what = "statistics of the whole global batch" if self.batchnorm == "sync" else "each device its own statistics"
        return f", BatchNorm {self.batchnorm} ({what})"


def _torch_dtype(dtype: str | torch.dtype | None, what: str, names: dict[str, torch.dtype]) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in names:
        raise ValueError(f"{what} {dtype!r} is unknown; choose one of {', '.join(names)}")
    return names[dtype]


_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Mixed precision by name (Lightning Fabric's): the autocast dtype of forward. Only bfloat16: it
# needs no loss scaling (float16's narrow exponent would need a GradScaler).
PRECISIONS = {"bf16-mixed": torch.bfloat16}


def prepare(model: nn.Module, *, world: World, dtype: str | torch.dtype | None = None, batchnorm: str = "sync",
            memory_format: str = "auto", algorithm: str = "auto", overlap: bool = True,
            bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB, grad_dtype: str | torch.dtype | None = None,
            comm: AsyncComm | None = None, precision: str | None = None, average: bool | None = None) -> DataParallel:
    """`model` as a replica on `world.device`, rank 0's state broadcast: a `DataParallel` whose
    `choices` say what was chosen. Call it at the same point on every rank (a collective).

    `dtype`: cast the model first (a name like "float64" or a torch dtype; None: as it is).
    `batchnorm`: `sync` or `local` (no effect without BatchNorm layers, nor on one device).
    `memory_format`: `auto`, `channels_last` or `contiguous`. `algorithm`, `grad_dtype` ("bf16",
    "fp16" or the torch dtype) and `comm`: as DataParallel's. `bucket_cap_mb` applies with
    `overlap`; without it the exchange is one flat bucket (every gloo call pays a ~1 ms floor,
    so when nothing overlaps, one call is fastest). `precision="bf16-mixed"`: forward under
    torch.autocast(bfloat16), outputs widened to float32, float32 weights and exchange (None:
    the dtype throughout). `average`: as DataParallel's (None: expects `shard_loss`; True: DDP's
    mean of per-rank means). A bad name raises ValueError before anything is converted.
    """
    check_choice(algorithm)
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is unknown; choose one of {', '.join(PRECISIONS)} (or None)")
    if average not in (None, True, False):
        raise ValueError(f"average must be None, True or False, got {average!r}")
    if batchnorm not in BATCHNORM_POLICIES:
        raise ValueError(f"batchnorm {batchnorm!r} is unknown; choose one of {', '.join(BATCHNORM_POLICIES)}")
    layout = resolve_memory_format(memory_format, model, world.device)  # the layers decide, not their dtype
    target_dtype = _torch_dtype(dtype, "dtype", _DTYPES)
    wire_dtype = _torch_dtype(grad_dtype, "grad_dtype", GRAD_DTYPES)
    wire_names = {value: name for name, value in GRAD_DTYPES.items()}
    if wire_dtype is not None and wire_dtype not in wire_names:
        raise ValueError(f"grad_dtype {wire_dtype} is not supported; use one of {', '.join(GRAD_DTYPES)}")
    weights = {target_dtype} if target_dtype is not None else {p.dtype for p in model.parameters()}
    if precision is not None and weights != {torch.float32}:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in weights))
        raise ValueError(f"precision {precision!r} keeps float32 weights, but the model's are {names}; "
                         "pass dtype=\"float32\" (or leave precision unset)")
    if target_dtype is not None:
        model = model.to(target_dtype)
    has_batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    # On one device plain BatchNorm already sees the whole batch (and SyncBatchNorm would read
    # its count on the host every step); a no-op for models without BatchNorm.
    if batchnorm == "sync" and world.distributed:
        model = convert_sync_batchnorm(model, world)
    model = apply_memory_format(model, layout)
    dp = DataParallel(model, world=world, algorithm=algorithm, overlap=overlap,
                      bucket_cap_mb=bucket_cap_mb if overlap else None, grad_dtype=wire_dtype, comm=comm,
                      average=average, autocast_dtype=PRECISIONS.get(precision), batchnorm=batchnorm)
    first = next(dp.module.parameters(), None)
    dp.choices = Choices(
        dtype=str(first.dtype).removeprefix("torch.") if first is not None else "no parameters",
        batchnorm=batchnorm, has_batchnorm=has_batchnorm, num_devices=world.world_size,
        memory_format=format_name(layout), requested_algorithm=algorithm, algorithm=dp.algorithm,
        fallback_reason=dp.fallback_reason, exchanging=dp.exchanging, overlap=overlap,
        bucket_kb=tuple(b.size_bytes / 1024 for b in dp.buckets),
        grad_dtype=None if wire_dtype is None else wire_names[wire_dtype], precision=precision,
        backend=world.backend, why_not_shm=shm_applies(world) if world.distributed else None)
    return dp
