"""`prepare`: the one place that turns a plain nn.Module into a replica ready to train on k devices.

In the spirit of Lightning Fabric's `setup` and Accelerate's `prepare`: a user's model goes in,
a `DataParallel` comes out, with phalanx's defaults applied in this order - the dtype; BatchNorm
per policy (`sync`: SyncBatchNorm, the whole global batch's statistics, when there is more than
one device; `local`: each device its own); the memory format (`auto`: channels_last for conv nets
on CPU, memory_format.py); then `DataParallel` with its exchange (allreduce algorithm, overlap,
bucket cap, wire dtype), optionally mixed precision (`precision="bf16-mixed"`: forward under
`torch.autocast`, weights and the gradient exchange float32). `phalanx train`, verify, predict, bench and the examples all prepare
their replicas here, so a user's own script gets what the CLI gets. The replica says what it runs
with as `dp.choices` (choices.py); `dp.choices.describe()` says it in one line (STYLE habit 14:
the run's first log line names the transport, the bucket layout and the memory format).
A world of one with no `comm` gets the plain loop (DataParallel builds no buckets or hooks).
"""

from __future__ import annotations

import torch
from torch import nn

from phalanx.comm import AsyncComm, check_choice
from phalanx.data_parallel.choices import GRAD_DTYPES, Choices, autocast_dtype
from phalanx.data_parallel.data_parallel import DEFAULT_BUCKET_CAP_MB, DataParallel
from phalanx.data_parallel.guards.finite import DEFAULT_CHECK_FINITE_EVERY
from phalanx.data_parallel.sharding.stages import check_shard
from phalanx.data_parallel.memory_format import apply_memory_format, resolve_memory_format
from phalanx.data_parallel.sync_batchnorm import BATCHNORM_POLICIES, convert_sync_batchnorm
from phalanx.runtime.world import World
from phalanx.telemetry import Tracer


def _torch_dtype(dtype: str | torch.dtype | None, what: str, names: dict[str, torch.dtype]) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in names:
        raise ValueError(f"{what} {dtype!r} is unknown; choose one of {', '.join(names)}")
    return names[dtype]


_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
__all__ = ["Choices", "prepare"]  # Choices: what the replica prepare returns says it runs with


def prepare(model: nn.Module, *, world: World, dtype: str | torch.dtype | None = None, batchnorm: str = "sync",
            memory_format: str = "auto", algorithm: str = "auto", overlap: bool = True,
            bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB, grad_dtype: str | torch.dtype | None = None,
            comm: AsyncComm | None = None, precision: str | None = None, average: bool | None = None,
            tracer: Tracer | None = None, shard: str = "none",
            check_finite_every: int = DEFAULT_CHECK_FINITE_EVERY) -> DataParallel:
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
    mean of per-rank means). `tracer`: where each bucket's exchange is traced (None: off).
    `shard`: none, optimizer, gradients or parameters (ZeRO stages 1-3: each rank keeps 1/k of
    the optimizer state, then the gradients, then the parameters; build the optimizer with
    `dp.optimizer(torch.optim.AdamW, lr=...)`). `check_finite_every`: synced steps between the
    gradient's NaN/Inf checks (0: off), as DataParallel's. A bad name raises ValueError before
    anything is converted.
    """
    check_choice(algorithm)
    check_shard(shard)
    autocast_dtype(precision)  # ValueError naming the valid precisions
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
    # On one device plain BatchNorm already sees the whole batch (and SyncBatchNorm would read
    # its count on the host every step); a no-op for models without BatchNorm.
    if batchnorm == "sync" and world.distributed:
        model = convert_sync_batchnorm(model, world)
    model = apply_memory_format(model, layout)
    return DataParallel(model, world=world, algorithm=algorithm, overlap=overlap,
                        bucket_cap_mb=bucket_cap_mb if overlap else None, grad_dtype=wire_dtype, comm=comm,
                        average=average, precision=precision, batchnorm=batchnorm, tracer=tracer, shard=shard,
                        check_finite_every=check_finite_every)
