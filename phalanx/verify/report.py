"""What `verify` hands back: per device count, the per-step numbers, the verdict and the named cause.

`VerifyReport.passed` is the verdict (every k agrees with 1 device within tolerance, the shards
are the global batches, the replicas agree); `render()` is the text `phalanx verify` prints and
`to_dict()` the JSON it writes with `--out` (flat, unit-free keys; non-finite numbers as strings).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from phalanx.data import shard_sizes
from phalanx.verify.compare import KINDS, Comparison
from phalanx.verify.config import VerifyConfig
from phalanx.verify.diagnose import Cause, ProbeResult

_KIND_LABEL = {"grad": "gradient", "param": "parameter", "buffer": "buffer"}


@dataclass(kw_only=True)
class WorldResult:
    world_size: int
    comparison: Comparison
    cause: Cause | None = None
    probes: list[ProbeResult] = field(default_factory=list)
    split: str = "data"  # how the k devices share the work: data splits each batch, the others the model

    @property
    def passed(self) -> bool:
        return self.comparison.passed


@dataclass(kw_only=True)
class VerifyReport:
    config: VerifyConfig
    results: list[WorldResult]
    title: str = ""  # e.g. the model's name, shown in the header

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def result(self, world_size: int) -> WorldResult:
        return next(r for r in self.results if r.world_size == world_size)

    def render(self) -> str:
        c = self.config
        extras = [f"gradients exchanged in {c.grad_dtype}"] if c.grad_dtype else []
        extras += ["batchnorm local"] if c.batchnorm == "local" else []
        extras += ["each rank shuffles alone"] if c.shuffle_per_rank else []
        lines = [f"verify{' ' + self.title if self.title else ''}: {c.steps} steps, {c.dtype}, lr {c.lr:g}, "
                 f"allreduce {c.algorithm}, loss {c.describe_loss_scale()}{''.join(', ' + e for e in extras)}; "
                 f"tolerance {c.rtol:g} (relative)"]
        for result in self.results:
            lines += ["", *_render_world(result)]
        failed = [r for r in self.results if not r.passed]
        verdict = "PASS" if not failed else "FAIL (" + "; ".join(
            f"k = {r.world_size}: {r.cause.key if r.cause else 'differs'}" for r in failed) + ")"
        lines += ["", f"verdict: {verdict}"]
        return "\n".join(lines)

    __str__ = render

    def to_dict(self) -> dict:
        config = asdict(self.config)
        config["loss_scale"] = self.config.describe_loss_scale()
        config["tolerance_rel"] = self.config.rtol
        return _finite({"passed": self.passed, "title": self.title, "config": config,
                        "results": [_world_dict(r) for r in self.results]})


def _render_world(result: WorldResult) -> list[str]:
    comparison, k = result.comparison, result.world_size
    n = comparison.batch_sizes[0] if comparison.batch_sizes else 0
    status = "PASS" if result.passed else "FAIL"
    shares = "+".join(map(str, shard_sizes(n, k))) if result.split == "data" else f"whole on each of the {k} devices"
    lines = [f"k = {k} vs 1 device (first batch {n} = {shares}): {status}, "
             f"max rel diff {comparison.max_rel:.2g}",
             "  step   grad abs   grad rel  param abs  param rel  buffer rel  worst (relative)"]
    for step in comparison.steps:
        worst_kind = max(KINDS, key=lambda kind: step.max_rel.get(kind, 0.0))
        lines.append(f"  {step.step:4d}  {_num(step.max_abs['grad'])}  {_num(step.max_rel['grad'])}  "
                     f"{_num(step.max_abs['param'])}  {_num(step.max_rel['param'])}   "
                     f"{_num(step.max_rel['buffer']) if 'buffer' in step.worst else '        -'}  "
                     f"{_KIND_LABEL[worst_kind]} {step.worst.get(worst_kind, '-')}")
    first = comparison.first_divergence
    if first is not None:
        count = sum(1 for d in comparison.steps[first.step - 1].beyond if d.kind == first.kind)
        lines.append(f"  first divergence: step {first.step}, {_KIND_LABEL[first.kind]} {first.name} "
                     f"(rel {first.rel_diff:.3g} > {comparison.rtol:g}; {count} {_KIND_LABEL[first.kind]}"
                     f"{'s' if count != 1 else ''} beyond tolerance at that step)")
    for label, text in (("data", comparison.data_mismatch), ("replicas", comparison.replica_mismatch)):
        if text:
            lines.append(f"  {label}: {text}")
    if result.cause is not None:
        lines += [f"  cause: {result.cause.summary}", f"  fix: {result.cause.fix}",
                  f"  evidence: {result.cause.evidence}"]
    return lines


def _world_dict(result: WorldResult) -> dict:
    comparison = result.comparison
    first = comparison.first_divergence
    return {
        "world_size": result.world_size, "passed": result.passed, "max_rel": comparison.max_rel,
        "batch_sizes": comparison.batch_sizes,
        "steps": [{"step": s.step, **{f"{kind}_max_abs": s.max_abs[kind] for kind in KINDS},
                   **{f"{kind}_max_rel": s.max_rel[kind] for kind in KINDS},
                   **{f"{kind}_worst": s.worst.get(kind) for kind in KINDS},
                   "beyond_tolerance": len(s.beyond)} for s in comparison.steps],
        "first_divergence": asdict(first) if first else None,
        "data_mismatch": comparison.data_mismatch, "replica_mismatch": comparison.replica_mismatch,
        "gradient_scale": comparison.gradient_scale,
        "cause": asdict(result.cause) if result.cause else None,
        "probes": [{"key": p.probe.key, "description": p.probe.description, "passed": p.comparison.passed,
                    "max_rel": p.comparison.max_rel} for p in result.probes],
    }


def _num(value: float) -> str:
    return f"{value:9.2e}" if math.isfinite(value) else f"{value!s:>9}"


def _finite(value):
    """JSON has no inf/nan: write them as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
