"""`phalanx predict` end to end: profile, measure the link, predict every k, and (optionally) check.

One round = for each global batch: profile one device at every k's setting (profile.py), on the
first batch measure the link if the interconnect asks for it (link.py), predict each k
(timeline.py), and with `validate` measure phalanx at each k on this machine (validate.py).
Rounds repeat the whole cycle, so prediction and measurement of a round see the same machine
load (others share these cores); every figure is reported as the median and min-max of rounds,
and the error of a round is predicted / measured - 1 from the same round. Other programs share
these cores and their load moves between the profile and the measurement, so each measurement
also notes the load it met, and a second error compares it with the prediction for that load
(timeline.timeslice_factor's fair share). Validation runs only
where it means something: k up to twice the cores (beyond that, workers mostly wait for the
scheduler).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from phalanx.measure.job_steps import StepJob
from phalanx.measure.timing import Spread
from phalanx.runtime.binding import available_cores
from phalanx.predict.config import PredictConfig
from phalanx.predict.link import LinkJob, measure_link, sweep_sizes
from phalanx.predict.profile import ProfileJob, phase_for, profile_devices
from phalanx.predict.timeline import StepPrediction, oversubscription, predict_step, timeslice_factor
from phalanx.predict.validate import measure_phalanx

PREDICTION_KEYS = ("compute_s", "comm_s", "hidden_s", "exposed_s", "overlap_penalty_s", "step_s", "timeslice")


def validated_world_sizes(config: PredictConfig, cores: int) -> tuple[int, ...]:
    if not config.validate:
        return ()
    return tuple(k for k in config.world_sizes_sorted if k <= max(2, 2 * cores))


def _link(config: PredictConfig, bucket_bytes: tuple[int, ...]) -> dict[str, Any]:
    """α, β, η to predict with: the interconnect's given values, the rest measured here."""
    link = config.interconnect
    values = {"alpha_s": link.alpha_s, "beta_Bps": link.beta_Bps, "overlap_efficiency": link.overlap_efficiency,
              "source": "given"}
    if link.measured:
        job = LinkJob(algorithm=config.algorithm, sizes_bytes=sweep_sizes(bucket_bytes), bucket_bytes=bucket_bytes)
        found = measure_link(job, timeout_s=config.timeout_s, deadline_s=config.deadline_s)
        measured = {"alpha_s": found.fit.alpha_s, "beta_Bps": found.fit.beta_Bps,
                    "overlap_efficiency": found.overlap_efficiency}
        values = {key: measured[key] if values[key] is None else values[key] for key in measured}
        values.update(source="measured", fit_max_rel_error=found.fit.max_rel_error,
                      sweep=[{"size_bytes": n, "time_s": t} for n, t in zip(found.sizes_bytes, found.times_s)],
                      comm_cpu_share=found.comm_cpu_share)
    return values


def _prediction_row(p: StepPrediction) -> dict[str, Any]:
    row = {key: getattr(p, key) for key in PREDICTION_KEYS}
    row.update(world_size=p.world_size, images_per_s=p.images_per_s, hidden_fraction=p.hidden_fraction)
    return row


def run_round(config: PredictConfig, cores: int, *, on_progress: Callable[[str], None]) -> dict[str, Any]:
    link: dict[str, Any] | None = None
    batches = []
    shares = config.interconnect.shares_host
    for batch in config.global_batch_sizes:
        phases = {k: phase_for(k, batch, cores, shares_host=shares, algorithm=config.algorithm, overlap=config.overlap)
                  for k in config.world_sizes_sorted}
        on_progress(f"profiling one device at global batch {batch} ({len(set(phases.values()))} settings)")
        job = ProfileJob(model=config.model, global_batch_size=batch, phases=tuple(dict.fromkeys(phases.values())),
                         bucket_cap_mb=config.bucket_cap_mb, warmup_steps=config.warmup_steps, steps=config.steps,
                         lr=config.lr, seed=config.seed)
        profiles = profile_devices(job, deadline_s=config.deadline_s)
        if link is None:
            if config.interconnect.measured:
                on_progress(f"measuring the loopback link ({config.algorithm} allreduce, 2 processes)")
            link = _link(config, next(iter(profiles.values())).bucket_bytes)
        predictions, measured = [], {}

        def predict(k: int, target_others: float | None = None) -> StepPrediction:
            phase, profile = phases[k], profiles[phases[k]]
            return predict_step(
                profile, world_size=k, global_batch_size=batch, algorithm=config.algorithm, alpha_s=link["alpha_s"],
                beta_Bps=link["beta_Bps"], overlap_efficiency=link["overlap_efficiency"],
                comm_stretch=oversubscription(k, phase.threads, cores, shares_host=shares),
                timeslice=timeslice_factor(k, phase.threads, cores, shares_host=shares, co_runners=phase.co_runners,
                                           others_busy_cores=profile.others_busy_cores,
                                           target_others_busy_cores=target_others))
        for k, phase in phases.items():
            profile = profiles[phase]
            row = _prediction_row(predict(k))
            row.update(batch_size_per_device=phase.batch_size_per_device, threads=phase.threads,
                       co_runners=phase.co_runners, overlap=phase.overlap, profile=dataclasses.asdict(profile))
            predictions.append(row)
        for k in validated_world_sizes(config, cores):
            on_progress(f"measuring phalanx on {k} device{'s' if k > 1 else ''} at global batch {batch}")
            found = measure_phalanx(StepJob(
                model=config.model, global_batch_size=batch, bucket_cap_mb=config.bucket_cap_mb,
                warmup_steps=config.warmup_steps, steps=config.steps, lr=config.lr, seed=config.seed),
                world_size=k, threads_per_device=phases[k].threads, algorithm=config.algorithm, overlap=config.overlap,
                timeout_s=config.timeout_s, deadline_s=config.deadline_s)
            # The same prediction, for the other load this measurement met (others share these cores).
            measured[str(k)] = {"images_per_s": found.images_per_s, "others_busy_cores": found.others_busy_cores,
                                "predicted_images_per_s_at_its_load": predict(k, found.others_busy_cores).images_per_s}
        batches.append({"global_batch_size": batch, "predictions": predictions, "measured": measured})
    return {"link": link, "batches": batches}


def summarize(config: PredictConfig, rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (batch, k): every prediction column as a spread over rounds; measured and error too."""
    rows = []
    for index, batch in enumerate(config.global_batch_sizes):
        for j, k in enumerate(config.world_sizes_sorted):
            preds = [r["batches"][index]["predictions"][j] for r in rounds]
            row: dict[str, Any] = {"global_batch_size": batch, "world_size": k,
                                   "batch_size_per_device": preds[0]["batch_size_per_device"],
                                   "threads": preds[0]["threads"], "co_runners": preds[0]["co_runners"],
                                   "overlap": preds[0]["overlap"]}
            for key in PREDICTION_KEYS + ("images_per_s", "hidden_fraction"):
                row[key] = Spread.of([p[key] for p in preds]).to_dict()
            # What other programs took while this k's device was profiled (report.py judges it).
            row["profile_others_busy_cores"] = Spread.of([p["profile"]["others_busy_cores"] for p in preds]).to_dict()
            measured = [r["batches"][index]["measured"].get(str(k)) for r in rounds]
            if all(m is not None for m in measured):
                row["measured_images_per_s"] = Spread.of([m["images_per_s"] for m in measured]).to_dict()
                row["error"] = Spread.of([p["images_per_s"] / m["images_per_s"] - 1
                                          for p, m in zip(preds, measured)]).to_dict()
                row["error_at_its_load"] = Spread.of([m["predicted_images_per_s_at_its_load"] / m["images_per_s"] - 1
                                                      for m in measured]).to_dict()
            rows.append(row)
    return rows


def run_prediction(config: PredictConfig, *, on_progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Every round, then the summary; the JSON payload (times in s, bandwidths in bytes/s)."""
    cores = available_cores()
    rounds = []
    for r in range(config.rounds):
        if config.rounds > 1:
            on_progress(f"round {r + 1} of {config.rounds}")
        rounds.append(run_round(config, cores, on_progress=on_progress))
    config_dict = dataclasses.asdict(config)
    return {"predict": config_dict, "cores": cores, "validated_world_sizes": list(validated_world_sizes(config, cores)),
            "rounds": rounds, "summary": summarize(config, rounds)}
