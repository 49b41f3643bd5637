"""The comparison of one k-device run with the 1-device reference: numbers per step and a verdict.

Per step and per kind of tensor (the gradient the optimizer used, the parameters and the
buffers after the update) it takes each tensor's largest absolute difference and its relative
difference, max|a - b| / max|b|, where b is the reference. A gradient that is zero in exact
arithmetic (a bias right before BatchNorm, whose shift the normalization cancels) holds only
rounding noise, which no two summation orders share; so the denominator never drops below
`RELATIVE_FLOOR` times the largest |b| of any tensor of the same kind at that step. The first
divergence is the earliest step with a tensor beyond tolerance and, within it, the first such
gradient in model order (the gradient causes the update), else parameter, else buffer.

Beside the numbers, two facts the numbers only hint at are checked directly: that the k shards
of every step put together are the 1-device batch (example fingerprints), and that every
replica holds the same parameters after every step (parameter fingerprints). `gradient_scale`
fits g_k = s * g_1 on step 1, where both runs start from the same parameters: a clean fit with
s far from 1 means the loss is scaled wrongly (s ~ k: summed instead of averaged).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from phalanx.data import shard_sizes
from phalanx.verify.run import RunRecord

KINDS = ("grad", "param", "buffer")
RELATIVE_FLOOR = 0.1
# gradient_scale: a fit counts as a clean rescaling when what it leaves over is below this share.
SCALE_FIT_RESIDUAL = 0.1


@dataclass(frozen=True, kw_only=True)
class TensorDiff:
    step: int  # 1-based
    kind: str  # one of KINDS
    name: str
    abs_diff: float
    rel_diff: float


@dataclass(kw_only=True)
class StepDiff:
    step: int  # 1-based
    max_abs: dict[str, float] = field(default_factory=dict)  # kind -> largest absolute difference
    max_rel: dict[str, float] = field(default_factory=dict)  # kind -> largest relative difference
    worst: dict[str, str] = field(default_factory=dict)  # kind -> tensor with the largest relative one
    beyond: list[TensorDiff] = field(default_factory=list)  # tensors past tolerance, in report order


@dataclass(kw_only=True)
class Comparison:
    world_size: int
    rtol: float
    steps: list[StepDiff]
    batch_sizes: list[int]  # global batch of each step
    first_divergence: TensorDiff | None
    data_mismatch: str | None  # what differs between the shards and the 1-device batch, if anything
    replica_mismatch: str | None  # the first step at which replicas disagree, if any
    gradient_scale: float | None  # s of g_k = s * g_1 at step 1 when that fits cleanly

    @property
    def passed(self) -> bool:
        return self.first_divergence is None and self.data_mismatch is None and self.replica_mismatch is None

    @property
    def max_rel(self) -> float:
        return max((max(s.max_rel.values(), default=0.0) for s in self.steps), default=0.0)

    @property
    def uneven_steps(self) -> list[int]:
        """1-based steps whose global batch does not split evenly over the k ranks."""
        return [i + 1 for i, n in enumerate(self.batch_sizes) if n % self.world_size]


def tensor_diff(a: torch.Tensor, b: torch.Tensor, *, scale: float) -> tuple[float, float]:
    """(max |a - b|, that / max(max |b|, RELATIVE_FLOOR * scale)); integer tensors: exact."""
    if a.shape != b.shape:
        return float("inf"), float("inf")
    if not b.is_floating_point():
        differ = float(bool((a != b).any()))
        return differ, float("inf") if differ else 0.0
    abs_diff = float((a - b).abs().max()) if b.numel() else 0.0
    if abs_diff == 0.0:
        return 0.0, 0.0
    denominator = max(float(b.abs().max()), RELATIVE_FLOOR * scale)
    return abs_diff, abs_diff / denominator if denominator > 0 else float("inf")


def compare_step(step: int, got: dict[str, dict[str, torch.Tensor]], want: dict[str, dict[str, torch.Tensor]],
                 *, rtol: float) -> StepDiff:
    """One step's numbers: `got` is rank 0's snapshot, `want` the reference's (kind -> name -> tensor)."""
    result = StepDiff(step=step)
    for kind in KINDS:
        tensors = want.get(kind, {})
        scale = max((float(t.abs().max()) for t in tensors.values() if t.is_floating_point() and t.numel()),
                    default=0.0)
        result.max_abs[kind], result.max_rel[kind] = 0.0, 0.0
        for name, reference in tensors.items():
            actual = got.get(kind, {}).get(name)
            abs_diff, rel_diff = (float("inf"), float("inf")) if actual is None else tensor_diff(
                actual, reference, scale=scale)
            result.max_abs[kind] = max(result.max_abs[kind], abs_diff)
            if kind not in result.worst or rel_diff > result.max_rel[kind]:
                result.max_rel[kind], result.worst[kind] = rel_diff, name
            if rel_diff > rtol:
                result.beyond.append(TensorDiff(step=step, kind=kind, name=name, abs_diff=abs_diff, rel_diff=rel_diff))
    return result


def check_data(reference: RunRecord, ranks: list[RunRecord]) -> str | None:
    """None when every step's shards, in rank order, are exactly the reference's global batch."""
    k = len(ranks)
    for step, want in enumerate(reference.example_digests):
        got = [d for record in ranks for d in record.example_digests[step]]
        if got == want:
            sizes = [record.shard_sizes[step] for record in ranks]
            if sizes != shard_sizes(len(want), k):
                return f"step {step + 1}: shards of {sizes} instead of {shard_sizes(len(want), k)}"
            continue
        if sorted(got) == sorted(want):
            return f"step {step + 1}: the ranks hold the batch's examples in another order"
        missing = len(set(want) - set(got))
        per_rank = [sum(d not in set(want) for d in record.example_digests[step]) for record in ranks]
        return (f"step {step + 1}: {missing} of the 1-device batch's {len(want)} examples are on no rank; "
                f"examples from outside it per rank: {per_rank}")
    return None


def check_replicas(ranks: list[RunRecord]) -> str | None:
    """None when every rank holds bitwise the same parameters after every step."""
    for step in range(len(ranks[0].param_digests)):
        digests = [record.param_digests[step] for record in ranks]
        if len(set(digests)) > 1:
            odd = [r for r, d in enumerate(digests) if d != digests[0]]
            return f"after step {step + 1} rank{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))} " \
                   f"hold{'' if len(odd) > 1 else 's'} other parameters than rank 0"
    return None


def gradient_scale(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float | None:
    """Least-squares s in got = s * want over every gradient, if the fit leaves < SCALE_FIT_RESIDUAL."""
    names = [n for n in want if n in got and want[n].is_floating_point()]
    if not names:
        return None
    g = torch.cat([got[n].reshape(-1).double() for n in names])
    w = torch.cat([want[n].reshape(-1).double() for n in names])
    denominator = float(w @ w)
    if denominator == 0.0:
        return None
    s = float(g @ w) / denominator
    residual = float((g - s * w).norm()) / max(float((s * w).norm()), 1e-300)
    return s if residual < SCALE_FIT_RESIDUAL else None


def compare_runs(reference: RunRecord, ranks: list[RunRecord], *, rtol: float) -> Comparison:
    """Rank 0's full record against the reference's, plus the data and replica checks over all ranks."""
    main = next(r for r in ranks if r.rank == 0)
    if reference.snapshots is None or main.snapshots is None:
        raise ValueError("compare_runs needs full records (snapshots) of the reference and of rank 0")
    steps = [compare_step(i + 1, got, want, rtol=rtol) for i, (got, want) in
             enumerate(zip(main.snapshots, reference.snapshots))]
    first = next((_first_in_step(s) for s in steps if s.beyond), None)
    ordered = sorted(ranks, key=lambda r: r.rank)
    scale = gradient_scale(main.snapshots[0]["grad"], reference.snapshots[0]["grad"]) if steps else None
    return Comparison(world_size=len(ranks), rtol=rtol, steps=steps, batch_sizes=list(reference.batch_sizes),
                      first_divergence=first, data_mismatch=check_data(reference, ordered),
                      replica_mismatch=check_replicas(ordered), gradient_scale=scale)


def _first_in_step(step: StepDiff) -> TensorDiff:
    # compare_step appends kind by kind (grad, param, buffer) and tensors in model order.
    return step.beyond[0]
