"""`phalanx predict --hosts H --link-gbit R`: the step on H hosts of m workers joined by links of
R Gbit/s, gloo's flat allreduce against the hierarchical one, from one device's profile and the
link model; `--validate` measures both on simulated hosts (phalanx/measure/hosts_run.py).

Per bucket of n bytes, with β = R/8 bytes/s a host's link and α the cost of one message across
it (costmodel.cost_terms, `hosts`):

    flat (gloo's ring over k = H·m ranks)   c = 2(k-1)·α + 2(k-1)/k · n/β
    hierarchical                            c = 2(H-1)·α·w + 2(H-1)/H · n/β,  w = ceil(n / 4 MiB)

(w: the windows a bucket crosses the hosts in, one gloo allreduce each, comm/hierarchical.py)
and the step is timeline.py's: the slowest of k ranks' compute, each bucket's exchange scheduled
from its ready time in backward, the part after backward exposed. η, the share of hidden
exchange that really hides, is 1 here: a host's link, not its cores, bounds the exchange (the
kernel's copies of a 23 MB bucket take milliseconds; the wire 0.19 s at 1 Gbit/s).

Where the hosts are decides the compute: `simulated` hosts (validation: the bed's k workers all
run on this machine's cores) are profiled as k processes sharing them (profile.phase_for); hosts
that are machines like this one run m workers each on their own cores. Assumptions of the
extrapolation (docs/many-hosts.md): a non-blocking switch (every host's link at R both ways at
once), α flat in H (no congestion, no incast), every host as fast as this one, torchrun's
numbering of ranks host by host.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

from phalanx.data import shard_sizes
from phalanx.measure.hosts_run import run_on_bed
from phalanx.measure.hosts_worker import BedJob
from phalanx.measure.timing import Spread
from phalanx.predict.config import PredictConfig
from phalanx.predict.profile import OVERSUBSCRIBE_PROFILED, Phase, ProfileJob, phase_for, profile_devices
from phalanx.predict.timeline import oversubscription, predict_step, timeslice_factor
from phalanx.runtime.binding import available_cores

ALGORITHMS = {"flat": "native", "hierarchical": "hierarchical"}


def host_phase(hosts: int, per_host: int, batch: int, cores: int, *, simulated: bool) -> Phase:
    """How one device runs: k = hosts·per_host sharing this machine (simulated), or per_host on
    a machine like this one."""
    k = hosts * per_host
    if simulated:  # flat and hierarchical both overlap (auto: their waits cost no core)
        return phase_for(k, batch, cores, shares_host=True, algorithm="hierarchical")
    threads = max(1, cores // per_host)
    return Phase(batch_size_per_device=shard_sizes(batch, k)[0], threads=threads,
                 co_runners=max(1, min(per_host, OVERSUBSCRIBE_PROFILED * cores // threads)))


def run_hosts_round(config: PredictConfig, cores: int, *, on_progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """One round: per batch and H, both predictions, and with `validate` both measured on the bed."""
    link = config.interconnect
    m, simulated = config.workers_per_host, config.validate
    rows = []
    for batch in config.global_batch_sizes:
        phases = {h: host_phase(h, m, batch, cores, simulated=simulated) for h in config.hosts}
        on_progress(f"profiling one device at global batch {batch} ({len(set(phases.values()))} settings)")
        profiles = profile_devices(ProfileJob(model=config.model, global_batch_size=batch,
                                              phases=tuple(dict.fromkeys(phases.values())),
                                              bucket_cap_mb=config.bucket_cap_mb, warmup_steps=config.warmup_steps,
                                              steps=config.steps, lr=config.lr, seed=config.seed),
                                   deadline_s=config.deadline_s)
        for h in config.hosts:
            phase, profile = phases[h], profiles[phases[h]]
            sharing = h * m if simulated else m  # the workers on one machine's cores
            row: dict[str, Any] = {"global_batch_size": batch, "hosts": h, "world_size": h * m,
                                   "batch_size_per_device": phase.batch_size_per_device, "threads": phase.threads}
            for name, algorithm in ALGORITHMS.items():
                p = predict_step(profile, world_size=h * m, global_batch_size=batch, algorithm=algorithm, hosts=h,
                                 alpha_s=link.alpha_s, beta_Bps=link.beta_Bps,
                                 overlap_efficiency=link.overlap_efficiency,
                                 comm_stretch=oversubscription(sharing, phase.threads, cores, shares_host=True),
                                 timeslice=timeslice_factor(sharing, phase.threads, cores, shares_host=True,
                                                            co_runners=phase.co_runners,
                                                            others_busy_cores=profile.others_busy_cores))
                row[name] = {"step_s": p.step_s, "compute_s": p.compute_s, "comm_s": p.comm_s,
                             "exposed_s": p.exposed_s}
            if config.validate:
                on_progress(f"measuring both on {h} simulated hosts x {m} workers at global batch {batch}")
                bed = run_on_bed(BedJob(model=config.model, global_batch_size=batch,
                                        contenders=("step flat", "step hierarchical"), rounds=1,
                                        warmup_steps=config.warmup_steps, steps=config.steps, lr=config.lr,
                                        timeout_s=config.timeout_s),
                                 hosts=h, per_host=m, link_gbit=config.link_gbit, deadline_s=config.deadline_s)
                for name in ALGORITHMS:
                    row[name]["measured_step_s"] = max(r["time_s"] for r in bed["records"]
                                                       if r["contender"] == f"step {name}")
            rows.append(row)
    return rows


def run_hosts_prediction(config: PredictConfig, *, on_progress: Callable[[str], None] = lambda _: None) -> dict:
    """Every round, then per (batch, H, algorithm) the spreads over rounds: the JSON payload."""
    cores = available_cores()
    rounds = [run_hosts_round(config, cores, on_progress=on_progress) for _ in range(config.rounds)]
    summary = []
    for index, first in enumerate(rounds[0]):
        row = {key: first[key] for key in ("global_batch_size", "hosts", "world_size", "batch_size_per_device",
                                           "threads")}
        for name in ALGORITHMS:
            runs = [r[index][name] for r in rounds]
            row[name] = {key: Spread.of([run[key] for run in runs]).to_dict() for key in runs[0]}
            if "measured_step_s" in runs[0]:
                row[name]["error"] = Spread.of([run["step_s"] / run["measured_step_s"] - 1 for run in runs]).to_dict()
        summary.append(row)
    link = config.interconnect
    return {"predict": {"model": config.model, "workers_per_host": config.workers_per_host,
                        "link_gbit": config.link_gbit, "alpha_s": link.alpha_s, "beta_Bps": link.beta_Bps,
                        "overlap_efficiency": link.overlap_efficiency, "simulated": config.validate,
                        "rounds": config.rounds},
            "cores": cores, "rounds": rounds, "summary": summary}


def report_hosts_prediction(payload: dict[str, Any]) -> str:
    """One line per (batch, H): predicted steps flat and hierarchical, their ratio, and measured
    steps with the errors where validated."""
    p = payload["predict"]
    where = (f"simulated on this machine ({payload['cores']} cores shared by every host)" if p["simulated"]
             else f"machines like this one ({payload['cores']} cores each)")
    lines = [f"predict {p['model']} on hosts of {p['workers_per_host']} workers, links of {p['link_gbit']:g} Gbit/s "
             f"(beta {p['beta_Bps'] / 1e9:.3f} GB/s, alpha {p['alpha_s'] * 1e6:.0f} us, overlap efficiency "
             f"{p['overlap_efficiency']:.2f}); hosts: {where}"]
    header = f"{'batch':>6}{'H':>5}{'k':>5}  {'flat step (s)':<16}{'hier step (s)':<16}{'flat/hier':>10}"
    validated = any("error" in row["flat"] for row in payload["summary"])
    if validated:
        header += f"  {'measured flat':<15}{'err':>7}  {'measured hier':<15}{'err':>7}"
    lines.append(header)
    for row in payload["summary"]:
        flat, hier = row["flat"]["step_s"]["median"], row["hierarchical"]["step_s"]["median"]
        line = (f"{row['global_batch_size']:>6}{row['hosts']:>5}{row['world_size']:>5}  {flat:<16.3f}{hier:<16.3f}"
                f"{flat / hier:>9.2f}x")
        if "error" in row["flat"]:
            for name in ALGORITHMS:
                measured = statistics.median(row[name]["measured_step_s"]["samples"])
                line += f"  {measured:<15.3f}{row[name]['error']['median']:>+7.1%}"
        lines.append(line)
    return "\n".join(lines)


def plot_hosts_prediction(payload: dict[str, Any]):
    """Predicted step against H, flat and hierarchical, one panel per global batch; measured
    steps as points where validated."""
    from phalanx.measure.outputs import new_figure

    batches = list(dict.fromkeys(row["global_batch_size"] for row in payload["summary"]))
    fig, axes = new_figure(len(batches))
    for ax, batch in zip(axes, batches):
        rows = [row for row in payload["summary"] if row["global_batch_size"] == batch]
        hosts = [row["hosts"] for row in rows]
        for name, color in (("flat", "gray"), ("hierarchical", "tab:blue")):
            ax.plot(hosts, [row[name]["step_s"]["median"] for row in rows], marker="o", color=color,
                    label=f"{name} (predicted)")
            measured = [(row["hosts"], row[name]["measured_step_s"]["median"]) for row in rows
                        if "measured_step_s" in row[name]]
            if measured:
                ax.scatter(*zip(*measured), marker="x", s=60, color=color, label=f"{name} (measured)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("hosts H")
        ax.set_ylabel("step (s)")
        ax.set_title(f"global batch {batch}, {payload['predict']['workers_per_host']} workers per host, "
                     f"{payload['predict']['link_gbit']:g} Gbit/s", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    return fig
