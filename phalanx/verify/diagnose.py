"""Naming the culprit when k devices do not train like 1: direct evidence first, then probes.

Some culprits leave direct evidence in a failed comparison: shards that are not the 1-device
batch (data order differing per rank), replicas that disagree, or a step-1 gradient that is a
clean multiple of the reference's (s ~ k: the ranks' mean losses summed instead of averaged;
s ~ 1/k: averaged twice), or a loss_fn whose mean is not over the examples (a token mean with
ignore_index; example_mean.py measures it). The others are found by probes: the same comparison rerun with one
suspect removed, and the first probe after which the runs agree names it -

    grad-dtype   gradients exchanged as computed         (compression error)
    batchnorm    BatchNorm layers in eval mode           (per-device BatchNorm statistics)
    rank-mean    every global batch cut to a multiple of k (per-rank mean on uneven shards)
    dropout      Dropout layers in eval mode             (per-rank dropout randomness)
    combined     all of the above that apply at once     (several culprits together)

Everything here is pure (configs and comparisons in, probes and causes out); api.py runs them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from phalanx.data import shard_sizes
from phalanx.verify.compare import Comparison
from phalanx.verify.config import VerifyConfig

# How close the fitted gradient scale must come to k (or 1/k) to name the loss scaling: uneven
# shards make a summed per-rank mean differ from k * the mean by a few percent.
SCALE_MATCH = 0.1
_MANTISSA_BITS = {"bf16": 8, "fp16": 11}  # with the implicit bit: relative rounding 2^-bits


@dataclass(frozen=True, kw_only=True)
class Cause:
    key: str  # data-order, replicas, loss-sum, loss-double-average, loss-scale, token-mean, grad-dtype,
    #           batchnorm, rank-mean, dropout, combined, unknown
    summary: str  # names the culprit, with this run's numbers
    fix: str
    evidence: str


@dataclass(frozen=True, kw_only=True)
class Probe:
    key: str
    description: str  # what the rerun changes
    changes: dict[str, Any] = field(default_factory=dict)  # VerifyConfig fields to replace

    def apply(self, config: VerifyConfig) -> VerifyConfig:
        return replace(config, diagnose=False, **self.changes)


@dataclass(frozen=True, kw_only=True)
class ProbeResult:
    probe: Probe
    comparison: Comparison


def direct_cause(comparison: Comparison, config: VerifyConfig) -> Cause | None:
    """A culprit the failed comparison shows by itself, or None (then probes decide)."""
    k = comparison.world_size
    if comparison.data_mismatch is not None:
        return Cause(key="data-order", summary="data order differing per rank: the ranks' shards are not the global "
                     "batch 1 device trains on",
                     fix="draw the same permutation on every rank (same seed; DistributedSampler.set_epoch on every "
                         "rank) and let each rank read only its contiguous share of each global batch",
                     evidence=f"fingerprints of every example each rank received: {comparison.data_mismatch}")
    if comparison.replica_mismatch is not None:
        return Cause(key="replicas", summary=f"replicas disagree: {comparison.replica_mismatch}",
                     fix="broadcast rank 0's parameters at start and give every rank the same summed gradient and "
                         "optimizer step (no rank-dependent update)",
                     evidence="fingerprints of every rank's parameters after every step")
    s = comparison.gradient_scale
    if s is None or abs(s - 1.0) <= SCALE_MATCH:
        return None
    evidence = f"step 1 (same parameters on both sides): gradient on {k} devices = {s:.4g} x the 1-device gradient"
    if abs(s / k - 1.0) <= SCALE_MATCH:
        return Cause(key="loss-sum", summary=f"summed vs averaged loss: the gradient is {s:.3g} x too large "
                     f"(k = {k}): the ranks' mean losses are summed, not averaged",
                     fix=f"divide each rank's mean loss by k = {k} (exact for uneven shards: loss sum / global "
                         "batch size, as phalanx's train_batch does)", evidence=evidence)
    if abs(s * k - 1.0) <= SCALE_MATCH:
        return Cause(key="loss-double-average", summary=f"loss averaged twice: the gradient is 1/{k} of the "
                     f"1-device one ({s:.3g}): the loss is divided by k and the summed gradients averaged again",
                     fix="divide by k once: either scale the loss or average the summed gradients, not both",
                     evidence=evidence)
    return Cause(key="loss-scale", summary=f"the gradient is {s:.3g} x the 1-device one: the loss (or its reduction) "
                 "is scaled differently on k devices", fix="make each rank backpropagate its loss sum / global batch "
                 "size", evidence=evidence)


def token_mean_cause(gap: float, world_size: int) -> Cause:
    """loss_fn averages over something other than the examples (example_mean.py measured `gap`)."""
    return Cause(key="token-mean", summary="loss_fn is not a mean over the examples (a token mean with ignore_index?): "
                 "each rank's mean over its own non-ignored tokens, times its examples, is not its share of the "
                 "global token mean", fix="return the loss sum (reduction=\"sum\") with loss_reduction=\"sum\"; in "
                 "training, phalanx.shard_loss(loss_sum, global count of real tokens), the count summed over the ranks "
                 "(phalanx.reduce(count, world=world))", evidence=f"first global batch, initial model in eval mode: "
                 f"the gradient of loss_fn on the whole batch and its {world_size} shards' gradients weighted by "
                 f"their examples differ by {gap:.2g} relative")


def plan_probes(config: VerifyConfig, *, world_size: int, batch_sizes: list[int], num_batchnorm: int,
                num_dropout: int) -> list[Probe]:
    """The probes worth running should k devices differ, most likely culprit first (known before any
    k-device run: the reference gives the batch sizes and the model's layers)."""
    k = world_size
    probes = []
    if config.grad_dtype is not None:
        probes.append(Probe(key="grad-dtype", description="gradients exchanged as computed", changes={"grad_dtype": None}))
    suspects = []
    bn = Probe(key="batchnorm", description="BatchNorm layers in eval mode",
               changes={"eval_modules": _union(config.eval_modules, "batchnorm")})
    if num_batchnorm and "batchnorm" not in config.eval_modules:
        suspects.append(bn)
    if any(n % k for n in batch_sizes) and config.trim_to_multiple is None:
        trim = Probe(key="rank-mean", description=f"every global batch cut to a multiple of {k}",
                     changes={"trim_to_multiple": k})
        # With per-device statistics on, BatchNorm is the likelier culprit; else uneven shards are.
        suspects.insert(0 if config.batchnorm != "local" else len(suspects), trim)
    if num_dropout and "dropout" not in config.eval_modules:
        suspects.append(Probe(key="dropout", description="Dropout layers in eval mode",
                              changes={"eval_modules": _union(config.eval_modules, "dropout")}))
    probes += suspects
    if len(probes) > 1:
        changes: dict[str, Any] = {}
        for probe in probes:
            for name, value in probe.changes.items():
                changes[name] = _union(changes.get(name, ()), *value) if name == "eval_modules" else value
        probes.append(Probe(key="combined", description="all of: " + "; ".join(p.description for p in probes),
                            changes=changes))
    return probes


def cause_from_probes(config: VerifyConfig, comparison: Comparison, results: list[ProbeResult], *,
                      num_batchnorm: int = 0) -> Cause:
    """The first probe after which the runs agree names the culprit; none: an unknown cause."""
    k = comparison.world_size
    for result in results:
        if not result.comparison.passed:
            continue
        key = result.probe.key
        evidence = f"rerun with {result.probe.description}: k = {k} and 1 device agree " \
                   f"(max rel diff {result.comparison.max_rel:.2g} <= {config.rtol:g})"
        if key == "grad-dtype":
            bits = _MANTISSA_BITS[config.grad_dtype]
            return Cause(key=key, summary=f"gradient compression: the exchanged gradients are rounded to "
                         f"{config.grad_dtype} ({bits} significant bits, up to {2.0 ** -bits:.1e} relative per "
                         f"element); max rel diff {comparison.max_rel:.2g} vs tolerance {config.rtol:g}",
                         fix=f"expected: that is compression's error; accept it with a tolerance above it (e.g. "
                             f"--tolerance {_headroom(comparison.max_rel):g}) or exchange gradients as computed",
                         evidence=evidence)
        if key == "batchnorm":
            where = "with --batchnorm local each device" if config.batchnorm == "local" else "each device"
            return Cause(key=key, summary=f"BatchNorm statistics: {where} normalizes with its own shard's mean and "
                         f"variance ({num_batchnorm} BatchNorm layer{'s' if num_batchnorm != 1 else ''}), 1 device "
                         "with the whole batch's", fix="synchronize the statistics (--batchnorm sync; "
                         "phalanx.data_parallel.convert_sync_batchnorm), or accept per-device statistics as the chapter "
                         "does (then k devices do not equal 1)", evidence=evidence)
        if key == "rank-mean":
            n = comparison.batch_sizes[comparison.uneven_steps[0] - 1]
            shards = "+".join(map(str, shard_sizes(n, k)))
            return Cause(key=key, summary=f"per-rank mean on uneven shards: the global batch of {n} splits "
                         f"{shards} over {k} ranks, and averaging the ranks' mean losses weights the smaller "
                         "shards' examples more", fix="scale each rank's loss sum by 1 / global batch size "
                         "(phalanx's train_batch does), not each rank's mean by 1 / k", evidence=evidence)
        if key == "dropout":
            return Cause(key=key, summary="per-rank dropout randomness: each rank draws the dropout masks for its "
                         "own shard, so they cannot be the masks 1 device draws for the whole batch",
                         fix="expected for dropout, not an exchange bug: seed each rank differently (seed + rank) "
                             "so the masks are independent, and verify with dropout off (eval_modules=('dropout',)); "
                             "for k devices = 1 device with dropout, draw the masks through phalanx.BatchRandom "
                             "(draws.route_dropout(model): docs/api.md)",
                         evidence=evidence)
        return Cause(key="combined", summary="several culprits together: each probe alone still differs, "
                     f"{result.probe.description} agrees", fix="fix each named part", evidence=evidence)
    first = comparison.first_divergence
    tried = "; ".join(f"{r.probe.description}: max rel {r.comparison.max_rel:.2g}" for r in results) or "none applied"
    where = f"{first.kind} of {first.name} at step {first.step}" if first else "no tensor"
    return Cause(key="unknown", summary=f"no usual culprit explains it; first divergence: {where}",
                 fix="look at what differs first (the tensor above) between your k-device step and a plain one",
                 evidence=f"probes tried: {tried}")


def _union(kinds: tuple[str, ...], *more: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys((*kinds, *more)))


def _headroom(value: float) -> float:
    """A round tolerance (1, 2 or 5 x a power of ten) at least twice `value`."""
    target = max(2 * value, 1e-300)
    exponent = math.floor(math.log10(target))
    return next(m * 10.0 ** exponent for m in (1, 2, 5, 10) if m * 10.0 ** exponent >= target * (1 - 1e-12))
