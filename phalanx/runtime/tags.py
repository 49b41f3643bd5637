"""What a collective is: its `Tag` as the caller names it (phase, bucket, step) and the kind of
collective it is (allreduce, reduce-scatter, all-gather), packed into the one int64 word the
collective board stores per call (board.py), and read back in words for an error message.

A code: op (bits 60-61), phase (55-59), bucket index (40-54), the tensor's dtype (34-39, 0: not
said), step (0-33). Peers compare codes to tell whether the n-th collective of each is the same
one (comm/watchdog.py); the dtype rides in the same word, so comparing it costs nothing more.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

# What a collective is for; the call site names it. The index of each name is its code (0: unset).
PHASES = ("", "gradient", "evaluation", "metrics", "broadcast", "checkpoint", "pre-flight check", "replica check",
          "allreduce", "set-up", "reduce-scatter", "all-gather",
          "parameters", "gradient norm", "NaN/Inf check", "barrier", "SyncBatchNorm forward",
          "SyncBatchNorm backward", "stop check", "first-step check", "sparse gradient rows", "stream batch sizes",
          "GradScaler inf check", "closure loss", "RNG states")
# parameters: a sharded bucket's all-gather; gradient norm: clipping's; NaN/Inf check: the finite
# check's small sum (periodic, and before any state leaves the replica); barrier: phalanx.barrier;
# SyncBatchNorm's: a layer's global statistics, and its backward's two sums, through a replica's exchange;
# stop check: whether any rank was asked to stop (runtime/stop_request.py), after a training step;
# first-step check: the sizes shard_loss got on each rank, compared at synced steps 1, 2, 4, 8, ... (guards/sizes.py)
# sparse gradient rows: the rows each rank's backward touched, summed after the buckets (data_parallel/sparse.py)
# stream batch sizes: each global batch's size on every rank, and whether it ends the stream (train/sharded_loader.py)
# GradScaler inf check: a sharded optimizer's found-inf flags, summed in unscale_ (data_parallel/guards/unscale.py)
# closure loss: the loss an optimizer's closure returned, summed over the ranks (data_parallel/guards/closure.py)
# RNG states: every rank's generators, gathered as `phalanx train` starts (job/survivors.py)
_PHASE_CODE = {name: code for code, name in enumerate(PHASES) if name}
# What a collective does, set by the collective itself: "allreduce" stands for every collective of
# allreduce's shape (the backend's broadcast and barrier too); the sharded two differ in kind.
OPS = ("allreduce", "reduce-scatter", "all-gather")
_OP_CODE = {name: code for code, name in enumerate(OPS)}
_OP_SHIFT, _PHASE_SHIFT, _INDEX_SHIFT, _STEP_MASK, _INDEX_MASK, _PHASE_MASK = 60, 55, 40, (1 << 34) - 1, (1 << 15) - 1, 31
# The dtypes a call can name (torch's names); one outside the list is not said (0), and not compared.
DTYPES = ("", "float32", "float64", "float16", "bfloat16", "complex64", "complex128", "int64", "int32", "int16",
          "int8", "uint8", "bool", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2")
_DTYPE_CODE = {name: code for code, name in enumerate(DTYPES) if name}
_DTYPE_SHIFT, _DTYPE_MASK = 34, 63
_GRADIENT = _PHASE_CODE["gradient"]
_GENERIC = {0, _PHASE_CODE["allreduce"], _PHASE_CODE["reduce-scatter"], _PHASE_CODE["all-gather"]}
assert len(PHASES) <= _PHASE_MASK + 1 and len(OPS) <= 4 and len(DTYPES) <= _DTYPE_MASK + 1


def with_dtype(code: int, dtype: object) -> int:
    """`code` naming the dtype of the tensor the call carries (a torch.dtype; None: not said)."""
    name = str(dtype).removeprefix("torch.") if dtype is not None else ""
    return code | (_DTYPE_CODE.get(name, 0) << _DTYPE_SHIFT)


def dtype_of(code: int) -> str:
    """The dtype's name a code carries ("float32"), or "" when the call did not say."""
    index = (code >> _DTYPE_SHIFT) & _DTYPE_MASK
    return DTYPES[index] if index < len(DTYPES) else ""


def without_dtype(code: int) -> int:
    """`code` with its dtype left out: what two calls that differ only in dtype share."""
    return code & ~(_DTYPE_MASK << _DTYPE_SHIFT)


def phase_code(phase: str) -> int:
    try:
        return _PHASE_CODE[phase]
    except KeyError:
        raise ValueError(f"unknown collective phase {phase!r}; use one of {', '.join(_PHASE_CODE)}") from None


@dataclass(frozen=True)
class Tag:
    """What a collective is, as its caller names it: every collective call takes one.

    `phase`: what it is for (PHASES); `index`: the gradient bucket; `step`: the steps this rank
    had synced when it issued the call, so step s's gradient bucket i is `Tag("gradient", i,
    step=s - 1)` (None: the caller does not know; the board fills in the last step it recorded).
    The defaults, "allreduce", "reduce-scatter", "all-gather", are calls that say nothing of
    themselves: peers compare only their size, kind and dtype. `op`: the kind (OPS), which the
    reduce-scatter and all-gather set on the tag they are given (`doing`), so a bucket's
    reduce-scatter never pairs with a peer's allreduce of the same bucket.
    """

    phase: str = "allreduce"
    index: int = 0
    step: int | None = None
    op: str = field(default="allreduce", kw_only=True)
    _bits: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.index <= _INDEX_MASK:
            raise ValueError(f"collective index {self.index} outside 0..{_INDEX_MASK}")
        if self.step is not None and not 0 <= self.step <= _STEP_MASK:
            raise ValueError(f"collective step {self.step} outside 0..{_STEP_MASK}")
        if self.op not in _OP_CODE:
            raise ValueError(f"unknown collective op {self.op!r}; use one of {', '.join(OPS)}")
        object.__setattr__(self, "_bits", (_OP_CODE[self.op] << _OP_SHIFT) | (phase_code(self.phase) << _PHASE_SHIFT)
                           | (self.index << _INDEX_SHIFT))

    def sent_from(self, src: int) -> "Tag":
        """A broadcast's tag with its source rank as the index, so peers that disagree on the
        source are in different collectives (the backend would wait for two senders' bytes)."""
        return dataclasses.replace(self, index=src & _INDEX_MASK) if self.phase == "broadcast" else self

    def doing(self, op: str) -> "Tag":
        """This tag on a collective of kind `op`: what reduce-scatter and all-gather enter."""
        return self if op == self.op else dataclasses.replace(self, op=op)

    def code(self, steps: int) -> int:
        """The tag as the board's one int64 word; `steps` stands in for a step the tag leaves open."""
        return self._bits | (steps if self.step is None else self.step)


def is_generic(code: int) -> bool:
    """True for a call tagged only with its kind ("allreduce", ...): nothing to compare but its
    size, kind and dtype."""
    return (code >> _PHASE_SHIFT) & _PHASE_MASK in _GENERIC


def op_of(code: int) -> str:
    """The kind of collective a code was entered as (OPS)."""
    return OPS[code >> _OP_SHIFT] if code >> _OP_SHIFT < len(OPS) else "a collective"


def describe(code: int, size_bytes: int = 0, *, exact: bool = False) -> str:
    """A tag in words: "step 76's gradient bucket 2 (5.5 KiB)", "evaluation after step 75 (24 B)",
    "reduce-scatter of step 3's gradient bucket 0"; `exact`: the size in bytes too, "(7.6 MiB,
    8,000,000 B)", for two sizes that round alike."""
    phase = (code >> _PHASE_SHIFT) & _PHASE_MASK
    index = (code >> _INDEX_SHIFT) & _INDEX_MASK
    steps = code & _STEP_MASK
    name = PHASES[phase] if phase < len(PHASES) and PHASES[phase] else "a collective"
    if name == "gradient":
        text = f"step {steps + 1}'s gradient bucket {index}"
    elif name == "broadcast":
        text = f"broadcast from rank {index}" + (f" after step {steps}" if steps else "")
    else:
        text = f"{name} after step {steps}" if steps else name
    op = op_of(code)
    if op != "allreduce" and name != op:
        text = f"{op} of {text}"
    if not size_bytes:
        return text
    rounded = format_bytes(size_bytes)
    return f"{text} ({rounded}, {size_bytes:,} B)" if exact and not rounded.endswith(" B") else f"{text} ({rounded})"


# The calls of a user's script that issue each phase, for the ranks that meet in different ones:
# the usual cause is a collective called on one rank only (under `if world.is_main:`).
_CALLERS = {
    "evaluation": "phalanx.evaluate or evaluate_dataset", "metrics": "phalanx.reduce",
    "broadcast": "phalanx.broadcast", "checkpoint": "phalanx.checkpoint", "barrier": "phalanx.barrier",
    "NaN/Inf check": "phalanx.checkpoint, dp.full_state_dict() or dp.close() (each checks the gradient first)",
    "replica check": "phalanx.checkpoint, evaluate_dataset, phalanx.evaluate or dp.close() (each compares the "
                     "replicas first)",
    "SyncBatchNorm forward": "a training-mode forward of a SyncBatchNorm model (dp.eval() before evaluating on "
                             "one rank)",
    "SyncBatchNorm backward": "a backward through SyncBatchNorm",
    "closure loss": "optimizer.step(closure) (LBFGS: each call of the closure sums the loss it returns)",
}


def called_by(code: int) -> str | None:
    """What in a user's script issues a collective of this tag (a phrase), or None when unsaid."""
    phase = (code >> _PHASE_SHIFT) & _PHASE_MASK
    return _CALLERS.get(PHASES[phase]) if phase < len(PHASES) else None


def gradient_step(code: int) -> int | None:
    """The step a gradient exchange's code names (whatever its kind); None for any other phase."""
    return code & _STEP_MASK if (code >> _PHASE_SHIFT) & _PHASE_MASK == _GRADIENT else None


def format_bytes(size_bytes: int) -> str:
    if size_bytes < 1024:
        return f"{size_bytes} B"
    if size_bytes < 1 << 20:
        return f"{size_bytes / 1024:.1f} KiB"
    return f"{size_bytes / (1 << 20):.1f} MiB"
