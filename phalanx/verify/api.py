"""`verify(model_fn, data, loss_fn=..., config=...)`: does k-device training equal 1-device training?

For each k of `config.world_sizes` it trains `config.steps` SGD steps on 1 device in this
process (the reference) and on k spawned workers (phalanx.runtime.launch, phalanx's DataParallel and
step), from the same seed on the same global batches, and compares them step by step
(compare.py). On a failure it names the culprit (diagnose.py): from direct evidence (the
comparison's, or loss_fn's on the first batch: example_mean.py), or from
reruns with one suspect removed at a time (probes). A small model's probes run in the same spawn
as the comparison, since starting workers costs more than a few steps; a large model's in one
more spawn, only after a failure.

    from phalanx.verify import VerifyConfig, verify
    report = verify(MyNet, (inputs, targets), loss_fn=my_loss, config=VerifyConfig(world_sizes=(2, 3)))
    print(report.render()); assert report.passed

`model_fn`, `loss_fn` and `data` travel to fresh processes, so they must pickle: module-level
functions or classes, `functools.partial` of them, tensors. `loss_fn(outputs, targets)` returns
the mean over the examples it gets (`loss_reduction="sum"`: their sum).
"""

from __future__ import annotations

import pickle
from dataclasses import replace
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.runtime.devices import DevicePlan
from phalanx.runtime.launch import LaunchSpec, launch
from phalanx.verify.batches import check_data
from phalanx.verify.compare import compare_runs
from phalanx.verify.config import VerifyConfig
from phalanx.verify.diagnose import ProbeResult, cause_from_probes, direct_cause, plan_probes, token_mean_cause
from phalanx.verify.example_mean import example_mean_gap
from phalanx.verify.report import VerifyReport, WorldResult
from phalanx.verify.run import RunRecord, rank_worker, reference_run
from phalanx.runtime.world import launcher_env, ranks_share_gpu

# Models up to this size run their diagnosis probes in the same spawn as the comparison itself.
EAGER_PROBES_MAX_PARAMETERS = 1_000_000


def verify(model_fn: Callable[[], nn.Module], data: Any, *, loss_fn: Callable = F.cross_entropy,
           config: VerifyConfig | None = None, title: str = "",
           log: Callable[[str], None] | None = None) -> VerifyReport:
    """Compare k-device with 1-device training for every k of the config; see the module docstring.

    Raises ValueError for data, functions or devices no run can use (before any process starts),
    phalanx.runtime.launch.WorkerFailed when a worker fails. `log` gets a line before each spawned run.
    """
    config = config if config is not None else VerifyConfig()
    check_data(data)
    for name, value in (("model_fn", model_fn), ("loss_fn", loss_fn), ("data", data)):
        _check_picklable(name, value)
    _check_devices(config)
    say = log or (lambda _line: None)
    references: dict[VerifyConfig, RunRecord] = {}

    def reference(run_config: VerifyConfig) -> RunRecord:
        key = replace(run_config, world_sizes=(2,), diagnose=False)  # what the 1-device run depends on
        if key not in references:
            references[key] = reference_run(model_fn, loss_fn, data, run_config, device=_reference_device(config))
        return references[key]

    results = []
    for k in config.world_sizes:
        main_reference = reference(config)
        probes = plan_probes(config, world_size=k, batch_sizes=main_reference.batch_sizes,
                             num_batchnorm=main_reference.num_batchnorm,
                             num_dropout=main_reference.num_dropout) if config.diagnose else []
        probe_configs = [probe.apply(config) for probe in probes]
        # Starting workers (~2 s of `import torch` each) costs far more than a few steps of a small
        # model, so its probes ride along in the same spawn; a large model's (whose full per-step
        # copies travel back to this process) run only after a failure.
        eager = bool(probes) and _num_parameters(main_reference) <= EAGER_PROBES_MAX_PARAMETERS
        say(f"k = {k}: {config.steps} step{'s' if config.steps > 1 else ''} on {k} {config.device} workers"
            + (f", with {len(probes)} diagnosis probe{'s' if len(probes) > 1 else ''}" if eager else ""))
        runs = _spawn(k, model_fn, loss_fn, data, [config, *(probe_configs if eager else [])])
        comparison = compare_runs(main_reference, runs[0], rtol=config.rtol)
        result = WorldResult(world_size=k, comparison=comparison)
        if not comparison.passed and config.diagnose:
            result.cause = direct_cause(comparison, config)
            if result.cause is None:
                gap = example_mean_gap(model_fn, loss_fn, data, config, world_size=k, device=_reference_device(config))
                result.cause = None if gap is None else token_mean_cause(gap, k)
            if result.cause is None:
                if probes and not eager:
                    say(f"k = {k}: differs; {len(probes)} probe{'s' if len(probes) > 1 else ''} on {k} workers")
                    runs = [runs[0], *_spawn(k, model_fn, loss_fn, data, probe_configs)]
                result.probes = [ProbeResult(probe=probe, comparison=compare_runs(reference(c), run, rtol=config.rtol))
                                 for probe, c, run in zip(probes, probe_configs, runs[1:])]
                result.cause = cause_from_probes(config, comparison, result.probes,
                                                 num_batchnorm=main_reference.num_batchnorm)
        results.append(result)
    return VerifyReport(config=config, results=results, title=title)


def _num_parameters(record: RunRecord) -> int:
    return sum(t.numel() for t in (record.initial or {}).values())


def _spawn(k: int, model_fn, loss_fn, data, configs: list[VerifyConfig]) -> list[list[RunRecord]]:
    """k workers run every config in turn; returns, per config, the k ranks' records by rank."""
    first = configs[0]
    names = tuple(f"{first.device}:{i}" for i in range(k))
    spec = LaunchSpec(plan=DevicePlan(names=names), threads_per_device=first.threads_per_device,
                      timeout_s=first.timeout_s, deadline_s=first.deadline_s)
    per_rank = launch(rank_worker, model_fn, loss_fn, data, tuple(configs), spec=spec)
    return [[per_rank[rank][i] for rank in range(k)] for i in range(len(configs))]


def _reference_device(config: VerifyConfig) -> torch.device:
    return torch.device("cuda:0") if config.device == "cuda" else torch.device("cpu")


def _check_devices(config: VerifyConfig) -> None:
    if launcher_env() is not None:
        raise ValueError("verify starts its own k workers for each k; run it directly, not under torchrun")
    if config.device != "cuda":
        return
    present = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if present < max(config.world_sizes) and not (present and ranks_share_gpu()):  # tests share one GPU
        raise ValueError(f"k = {max(config.world_sizes)} needs {max(config.world_sizes)} GPUs but {present} "
                         f"{'is' if present == 1 else 'are'} present; use fewer devices or device='cpu'")


def _check_picklable(name: str, value: Any) -> None:
    try:
        pickle.dumps(value)
    except Exception as exc:  # noqa: BLE001 - pickling raises many types; all mean the same here
        raise ValueError(f"{name} cannot be sent to the worker processes ({type(exc).__name__}: {exc}); use a "
                         "module-level function or class (or functools.partial of one), not a lambda or "
                         "local function") from None
