"""What a replica runs with: `Choices`, the facts behind the run's first log line (STYLE habit 14:
which transport, bucket layout, memory format ran).

A `DataParallel` computes its own `choices` once built (`replica_choices`), from what it holds -
its parameters, buckets, the allreduce that opened - and the options it was built with (config.py);
nothing is assigned to it from outside. `dp.choices.describe()` says it in one line.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from phalanx.comm import shm_applies
from phalanx.comm.hosts import hierarchy_text
from phalanx.data_parallel.config import GRAD_DTYPES, DataParallelConfig
from phalanx.data_parallel.memory_format import layout_of
from phalanx.data_parallel.sharding.stages import SHARD_STAGES
from phalanx.data_parallel.sync_batchnorm import has_plain_batchnorm


@dataclass(frozen=True, kw_only=True)
class Choices:
    """What one replica runs with: the facts behind the run's first log line."""

    dtype: str  # the parameters' dtype, e.g. "float32"
    batchnorm: str  # the policy: "sync" or "local"
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
    shard: str = "none"  # what each rank keeps a share of (sharding/stages.py), "none": everything whole
    requested_shard: str = "none"  # what was asked for (one device runs "none" whatever was asked)
    hierarchy: str | None = None  # the hosts' layout in words, where the hierarchical allreduce runs
    shm_rounds: str | None = None  # how the shared segment's rounds run: "compiled", "Python (why)"; None: no segment
    overlap_reason: str | None = None  # what overlap "auto" saw (config.resolve_overlap); None: it was given
    memory_format_reason: str | None = None  # why "auto" ended contiguous (format_fallback.py), or None
    bucket_cap_mb: float | None = None  # the cap the buckets were cut at (None: one bucket)
    bucket_cap_auto: bool = False  # True: the cap is the allreduce's default (config.bucket_cap_for)

    def describe(self) -> str:
        """One line: allreduce, gradient exchange, memory format, dtype and (if any) BatchNorm."""
        mixed = f", {self.precision} (autocast forward, float32 weights and gradients)" if self.precision else ""
        exchange = f"allreduce {self._algorithm_text()}, " if self.exchanging else ""  # one device sums nothing
        return f"{exchange}{self._exchange_text()}{self._shard_text()}, " \
               f"{self._format_text()}, {self.dtype}{mixed}{self._batchnorm_text()}"

    def _format_text(self) -> str:
        return f"{self.memory_format} ({self.memory_format_reason})" if self.memory_format_reason else self.memory_format

    def _shard_text(self) -> str:
        if self.shard == "none":
            asked = self.requested_shard != "none"
            return f", shard {self.requested_shard} not applied (one device: nothing to shard)" if asked else ""
        kept = {"optimizer": "optimizer state", "gradients": "optimizer state and gradients",
                "parameters": "optimizer state, gradients and parameters"}[self.shard]
        stage = SHARD_STAGES.index(self.shard)
        return f", sharded (ZeRO-{stage}): each rank keeps 1/{self.num_devices} of the {kept}"

    def _algorithm_text(self) -> str:
        text = self._chosen_text()
        if self.shm_rounds is not None and self.shm_rounds != "compiled":  # the slower path is named
            text += f", rounds in {self.shm_rounds}"
        return text

    def _chosen_text(self) -> str:
        if self.algorithm == "hierarchical" and self.hierarchy is not None:
            why = (f" (auto: {self.num_devices} ranks span hosts, and memory is shared within a host only)"
                   if self.requested_algorithm == "auto" else "")
            return f"hierarchical: {self.hierarchy}{why}"
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
        # a bucket under 0.1 KB (a small head, a test model) keeps two digits rather than reading 0.0
        sizes = ", ".join(f"{kb:.1f}" if kb >= 0.1 else f"{kb:.2g}" for kb in self.bucket_kb)
        wire = f" sent as {self.grad_dtype}" if self.grad_dtype else ""
        mode = "overlapped" if self.overlap else "synchronous"
        what = "gradient exchange" if self.shard == "none" else "gradient reduce-scatter"
        why = f" (auto: {self.overlap_reason})" if self.overlap_reason else ""
        return f"{mode} {what}{why} in {len(self.bucket_kb)} bucket(s) of [{sizes}] KB{self._cap_text()}{wire}"

    def _cap_text(self) -> str:
        if self.bucket_cap_mb is None:  # one flat bucket, asked for or without overlap
            return ""
        return f" (cap {self.bucket_cap_mb:g} MB{f', auto for {self.algorithm}' if self.bucket_cap_auto else ''})"

    def _batchnorm_text(self) -> str:
        if not self.has_batchnorm:
            return ""
        if self.num_devices == 1:
            return f", BatchNorm {self.batchnorm} (one device: plain BatchNorm sees the whole batch)"
        what = "statistics of the whole global batch" if self.batchnorm == "sync" else "each device its own statistics"
        return f", BatchNorm {self.batchnorm} ({what})"


def replica_choices(dp, options: DataParallelConfig) -> Choices:
    """The `Choices` of a built replica `dp` (a DataParallel): its own facts, and the `options` it
    was asked for. The BatchNorm policy is the one asked for, except "sync" on k devices over
    layers nobody converted (a DataParallel built without prepare): those normalize locally."""
    module, world = dp.module, dp.world
    first = next(module.parameters(), None)
    wire_names = {value: name for name, value in GRAD_DTYPES.items()}
    unapplied = world.distributed and has_plain_batchnorm(module)
    return Choices(
        dtype=str(first.dtype).removeprefix("torch.") if first is not None else "no parameters",
        batchnorm="local" if unapplied else options.batchnorm,
        has_batchnorm=any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules()),
        num_devices=world.world_size, memory_format=layout_of(module), requested_algorithm=options.allreduce,
        algorithm=dp.algorithm, fallback_reason=dp.fallback_reason, exchanging=dp.exchanging, overlap=dp.overlap,
        overlap_reason=dp.overlap_reason, memory_format_reason=dp._format.reason,
        bucket_kb=tuple(b.size_bytes / 1024 for b in dp.buckets), grad_dtype=wire_names.get(dp.grad_dtype),
        precision=options.precision, backend=world.backend,
        why_not_shm=shm_applies(world) if world.distributed else None, shard=dp.shard,
        requested_shard=options.shard, hierarchy=hierarchy_text(world) if dp.algorithm == "hierarchical" else None,
        shm_rounds=dp.shm_rounds, bucket_cap_mb=dp._layout.bucket_cap_mb if dp._layout is not None else None,
        bucket_cap_auto=options.bucket_cap_mb == "auto")
