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

`prepare`'s keywords build the replica's options (`DataParallelConfig`, config.py), which check
themselves, and name a bad value by its keyword; `prepare_replica` takes such an object whole
(`phalanx train` hands it its config's). A world of one gets the plain loop (DataParallel builds
no buckets or hooks) unless the options say `exchange_alone`.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch
from torch import nn

from phalanx.comm import resolve_algorithm
from phalanx.data_parallel.guards.nodes import check_same_model
from phalanx.data_parallel.choices import Choices
from phalanx.data_parallel.config import GRAD_DTYPES, DataParallelConfig, resolve_overlap
from phalanx.data_parallel.data_parallel import DataParallel
from phalanx.data_parallel.guards.finite import DEFAULT_CHECK_FINITE_EVERY
from phalanx.data_parallel.memory_format import apply_memory_format, resolve_memory_format
from phalanx.data_parallel.unfit import refuse_unfit
from phalanx.data_parallel.sync_batchnorm import convert_sync_batchnorm
from phalanx.options import OptionError
from phalanx.runtime.call_habits import phalanx_call
from phalanx.runtime.foreign_names import foreign_keywords_error
from phalanx.runtime.world import World
from phalanx.telemetry import Tracer

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
__all__ = ["Choices", "prepare", "prepare_replica"]  # Choices: what the replica prepare returns says it runs with


@phalanx_call  # the World by position: one line (call_habits.py)
def prepare(model: nn.Module, *not_the_model: object, world: World | None = None,
            dtype: str | torch.dtype | None = None, batchnorm: str = "sync",
            memory_format: str = "auto", algorithm: str = "auto", overlap: bool | None = None,
            bucket_cap_mb: float | str | None = "auto", grad_dtype: str | torch.dtype | None = None,
            precision: str | None = None, average: bool | None = None, tracer: Tracer | None = None,
            shard: str = "none", check_finite_every: int = DEFAULT_CHECK_FINITE_EVERY,
            **not_phalanx_options: object) -> DataParallel:
    """`model` as a replica on `world.device`, rank 0's state broadcast: a `DataParallel` whose
    `choices` say what was chosen. Call it at the same point on every rank (a collective).

    `dtype`: cast the model first (a name like "float64" or a torch dtype; None: as it is).
    `batchnorm`: `sync` or `local` (no effect without BatchNorm layers, nor on one device).
    `memory_format`: `auto`, `channels_last` or `contiguous`. `algorithm`: the allreduce (auto,
    native, shm, ring, tree, naive). `grad_dtype`: "bf16", "fp16" (or the torch dtype), the
    exchange's wire dtype. `overlap`: True sends each bucket beside backward, False exchanges
    after backward on the calling thread, None decides per host (DataParallelConfig's).
    `bucket_cap_mb` applies with overlap ("auto": 25 MB for native, 0.25 MB for the others,
    config.py's table); without it the exchange is one flat bucket (every gloo call pays a ~1 ms
    floor, so when nothing overlaps, one call is fastest). `precision="bf16-mixed"`: forward under
    torch.autocast(bfloat16), outputs widened to float32, float32 weights and exchange (None: the
    dtype throughout). `average`: None expects `shard_loss`; True: DDP's mean of per-rank means.
    `tracer`: where each bucket's exchange is traced (None: off). `shard`: none, optimizer,
    gradients or parameters (ZeRO stages 1-3: each rank keeps 1/k of the optimizer state, then the
    gradients, then the parameters; build the optimizer with `dp.optimizer(torch.optim.AdamW,
    lr=...)`).
    `check_finite_every`: synced steps between the gradient's NaN/Inf checks and the replicas'
    comparison (guards/replicas.py; 0: both off). A bad
    value raises ValueError before anything is converted. Accelerate's and Fabric's habits, more
    objects than the model and no `world`, and DDP's keywords (`find_unused_parameters=`, ...) are a
    TypeError naming phalanx's way.
    """
    if not_phalanx_options:
        raise foreign_keywords_error(list(not_phalanx_options))
    if not_the_model:
        given = ", ".join(type(thing).__name__ for thing in not_the_model)
        raise TypeError(f"prepare takes the model alone, got {given} after it (Accelerate's prepare(model, optimizer, "
                        "loader), Fabric's setup(model, optimizer)): build the optimizer over dp.parameters() and load "
                        "the data with phalanx.ShardedLoader(dataset, world=world, global_batch_size=...)")
    if isinstance(grad_dtype, torch.dtype):  # the options hold the wire dtype's name
        names = {value: name for name, value in GRAD_DTYPES.items()}
        if grad_dtype not in names:
            raise ValueError(f"grad_dtype {grad_dtype} is not supported; use one of {', '.join(GRAD_DTYPES)}")
        grad_dtype = names[grad_dtype]
    try:
        options = DataParallelConfig(allreduce=algorithm, overlap=overlap, bucket_cap_mb=bucket_cap_mb,
                                     grad_dtype=grad_dtype, memory_format=memory_format, batchnorm=batchnorm,
                                     shard=shard, precision=precision, average=average,
                                     check_finite_every=check_finite_every)
    except OptionError as exc:  # named as this function's keywords, not as the flags
        raise exc.named({"allreduce": "algorithm"}) from None
    if world is None:  # after the values' checks, which need no world
        raise TypeError("prepare needs world=: world = phalanx.init(), then phalanx.prepare(model, world=world)")
    dp = prepare_replica(model, options, world=world, dtype=dtype, tracer=tracer)
    _note_python_rounds(dp, world)
    return dp


_NOTED_PYTHON_ROUNDS = False  # once per process: a script that prepares several models hears it once


def _note_python_rounds(dp: DataParallel, world: World) -> None:
    """Rank 0 says once, on stderr, that the shm allreduce runs its rounds in Python and why (no C
    compiler: a slim container image): 3-4x the CPU of the compiled rounds per small round. `phalanx
    train`'s first line names it; a script's run said nothing, only dp.choices.describe() did."""
    global _NOTED_PYTHON_ROUNDS
    rounds = dp.choices.shm_rounds
    if _NOTED_PYTHON_ROUNDS or not world.is_main or rounds is None or rounds == "compiled":
        return
    _NOTED_PYTHON_ROUNDS = True
    print(f"phalanx: note: the shm allreduce runs its rounds in {rounds}: each small round costs 3-4x the CPU "
          "of the compiled ones; install a C compiler (e.g. apt install gcc) or set CC to one", file=sys.stderr,
          flush=True)


def prepare_replica(model: nn.Module, options: DataParallelConfig, *, world: World,
                    dtype: str | torch.dtype | None = None, tracer: Tracer | None = None) -> DataParallel:
    """`prepare` with the replica's options as one object: `model` cast to `dtype`, its BatchNorm
    and memory format as `options` say, then the `DataParallel` built with them (`bucket_cap_mb`
    applying with `overlap` only: without it, one flat bucket)."""
    refuse_unfit(model, world_size=world.world_size)  # before any conversion touches a lazy module's parameters
    layout = resolve_memory_format(options.memory_format, model, world.device)  # the layers decide, not their dtype
    if dtype is not None and not isinstance(dtype, torch.dtype) and dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is unknown; choose one of {', '.join(_DTYPES)}")
    target_dtype = _DTYPES.get(dtype, dtype)
    weights = {target_dtype} if target_dtype is not None else {p.dtype for p in model.parameters()}
    if options.precision is not None and weights != {torch.float32}:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in weights))
        raise ValueError(f"precision {options.precision!r} keeps float32 weights, but the model's are {names}; "
                         "pass dtype=\"float32\" (or leave precision unset)")
    if target_dtype is not None:
        model = model.to(target_dtype)
    # On one device plain BatchNorm already sees the whole batch (and SyncBatchNorm would read
    # its count on the host every step); a no-op for models without BatchNorm.
    if options.batchnorm == "sync" and world.distributed:
        model = convert_sync_batchnorm(model, world)
    model = apply_memory_format(model, layout)
    overlap, _ = resolve_overlap(options.overlap, algorithm=resolve_algorithm(options.allreduce, world),
                                 local_workers=world.local_world_size)
    if not overlap:  # nothing goes out before backward ends: one call is cheapest
        options = replace(options, bucket_cap_mb=None)
    check_same_model(world, model, options)  # across nodes, before the broadcast the board cannot guard there
    return DataParallel(model, world=world, options=options, tracer=tracer)
