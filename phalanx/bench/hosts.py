"""`phalanx bench hosts`: gloo's flat allreduce against the hierarchical one on simulated hosts -
time per allreduce and per training step, the bytes each host's link carried against the formula,
bus bandwidth.

The bed (phalanx/measure/hosts_bed.py) is H network namespaces on this machine joined by links
shaped to `link_gbit` each way; one torchrun agent per host starts m workers
(measure/hosts_run.py), which time every contender in interleaved rounds (measure/hosts_worker.py).
The formulas, per allreduce of S bytes, for what one host sends on its link:

- flat, gloo's ring over k = H·m ranks numbered host by host (torchrun's numbering): the ring
  crosses each host's link once each way, and every rank sends 2(k-1)/k · S to its neighbour;
- hierarchical: each host's m ranks exchange 1/m of the bucket (or one leader all of it) with
  their peers on the other hosts, 2(H-1)/H · S per host in all.

So on a link-bound bed the hierarchical allreduce can be at most (k-1)/k · H/(H-1) times as fast
as the flat one: 1.5x at 2 hosts x 2 workers, 1.75x at 2 x 4, approaching m as H grows (the
flat ring pays for every worker on the link; the hierarchy for one host). busbw is nccl-tests'
(telemetry/bandwidth.py): algbw · 2(k-1)/k with algbw = S / time. Needs root and iproute2 (the bed's
`bed_unavailable` says why not, in one line); the machine's cores are shared by all hosts, so a
step's compute is k workers' on this machine's cores, not one host's.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from phalanx.errors import RunFailed, UsageError
from phalanx.measure.hosts_bed import BedError, bed_unavailable
from phalanx.measure.hosts_run import BedRunFailed, run_on_bed
from phalanx.measure.hosts_worker import CONTENDERS, BedJob
from phalanx.measure.mlp import BENCH_MODELS
from phalanx.measure.outputs import new_figure
from phalanx.measure.timing import Spread
from phalanx.options import at_least, check_options, finite, option, positive
from phalanx.telemetry.bandwidth import busbw_factor


@dataclass(frozen=True, kw_only=True)
class HostsBenchConfig:
    """flat vs hierarchical allreduce on simulated hosts: time, bytes per link, busbw"""

    hosts: int = option(2, check=at_least(2), help="simulated hosts H (network namespaces, one torchrun agent each)")
    workers_per_host: int = option(2, check=at_least(1), help="workers m per host (torchrun --nproc-per-node)")
    link_gbit: float = option(1.0, check=finite(positive("number of Gbit/s")),
                              help="each host's link, each way, in Gbit/s (tbf)")
    model: str = option("mlp", choices=BENCH_MODELS, help="the model whose gradient and step are timed")
    global_batch_size: int = option(128, flag="--batch-size", check=at_least(1), help="global batch of the step")
    allreduce_calls: int = option(3, check=at_least(1), help="allreduces of the whole gradient per round")
    steps: int = option(3, check=at_least(1), help="timed training steps per contender per round")
    warmup_steps: int = option(2, check=at_least(0), help="untimed steps first")
    rounds: int = option(3, check=at_least(1), help="interleaved rounds")
    timeout_s: float = 120.0  # bound on one collective
    deadline_s: float = 1800.0  # bound on the whole bed run

    def __post_init__(self) -> None:
        check_options(self)
        k = self.hosts * self.workers_per_host
        if self.global_batch_size < k:
            raise ValueError(f"--batch-size {self.global_batch_size} is smaller than {k} workers "
                             f"({self.hosts} hosts x {self.workers_per_host}); give at least one image each")

    @property
    def world_size(self) -> int:
        return self.hosts * self.workers_per_host


def formula_bytes(contender: str, size_bytes: float, *, hosts: int, world_size: int) -> float:
    """What one host sends on its link per allreduce (or step) of `size_bytes` (module docstring)."""
    if "flat" in contender:
        return 2 * (world_size - 1) / world_size * size_bytes
    return 2 * (hosts - 1) / hosts * size_bytes


def require_bed(config: HostsBenchConfig) -> HostsBenchConfig:
    """`config`, if this machine can hold the bed; UsageError saying why not (before anything is written)."""
    why_not = bed_unavailable()
    if why_not is not None:
        raise UsageError(f"bench hosts needs simulated hosts, and {why_not}")
    return config


def run_hosts_bench(config: HostsBenchConfig) -> dict[str, Any]:
    """The bed run and its summary: the JSON payload (times in s, bytes, bandwidths in bytes/s)."""
    job = BedJob(model=config.model, global_batch_size=config.global_batch_size, contenders=CONTENDERS,
                 rounds=config.rounds, allreduce_calls=config.allreduce_calls, warmup_steps=config.warmup_steps,
                 steps=config.steps, timeout_s=config.timeout_s)
    try:
        bed = run_on_bed(job, hosts=config.hosts, per_host=config.workers_per_host, link_gbit=config.link_gbit,
                         deadline_s=config.deadline_s)
    except (BedError, BedRunFailed) as exc:  # what the bed or a host's agent said, after this line
        raise RunFailed(f"bench hosts: the simulated hosts failed: {exc}") from exc
    return {"config": asdict(config), "first_line": bed["first_line"], "gradient_bytes": bed["gradient_bytes"],
            "rows": summarize(bed["records"], gradient_bytes=bed["gradient_bytes"], hosts=config.hosts,
                              world_size=config.world_size, link_gbit=config.link_gbit),
            "records": bed["records"]}


def summarize(records: list[dict], *, gradient_bytes: int, hosts: int, world_size: int,
              link_gbit: float) -> list[dict[str, Any]]:
    """One row per contender: time (the slowest rank's, per round), bytes sent per host link
    (mean of hosts, per round) against the formula, algbw and busbw, the link's utilization."""
    rows = []
    for contender in [c for c in CONTENDERS if any(r["contender"] == c for r in records)]:
        rounds = sorted({r["round"] for r in records if r["contender"] == contender})
        times, sent = [], []
        for index in rounds:
            mine = [r for r in records if r["contender"] == contender and r["round"] == index]
            times.append(max(r["time_s"] for r in mine))
            sent.append(statistics.fmean(r["sent_bytes"] for r in mine if r["local_rank"] == 0))
        time_s, sent_bytes = Spread.of(times), Spread.of(sent)
        formula = formula_bytes(contender, gradient_bytes, hosts=hosts, world_size=world_size)
        algbw = gradient_bytes / time_s.median
        rows.append({"contender": contender, "time_s": time_s.to_dict(), "sent_bytes": sent_bytes.to_dict(),
                     "formula_bytes": formula, "bytes_error": sent_bytes.median / formula - 1,
                     "algbw_Bps": algbw, "busbw_Bps": algbw * busbw_factor(world_size),
                     "link_utilization": sent_bytes.median / time_s.median / (link_gbit * 1e9 / 8)})
    return rows


def speedups(payload: dict[str, Any]) -> dict[str, float]:
    """Flat time / hierarchical time, per kind (allreduce with the default variant, and step)."""
    by = {row["contender"]: row["time_s"]["median"] for row in payload["rows"]}
    pairs = {"allreduce": ("allreduce flat", "allreduce hierarchical/slices"),
             "step": ("step flat", "step hierarchical")}
    return {kind: by[flat] / by[hier] for kind, (flat, hier) in pairs.items() if flat in by and hier in by}


def report_hosts(payload: dict[str, Any]) -> str:
    """The terminal table: one line per contender, then the speed-ups and the first line."""
    c = payload["config"]
    lines = [f"bench hosts: {c['hosts']} simulated hosts x {c['workers_per_host']} workers, links of "
             f"{c['link_gbit']:g} Gbit/s each way (tbf), {c['model']} ({payload['gradient_bytes'] / 1e6:.1f} MB "
             f"gradient), global batch {c['global_batch_size']}, {c['rounds']} rounds (median, min-max)",
             f"{'contender':<32}{'time (s)':<24}{'sent per link (MB)':<22}{'formula (MB)':<14}{'off':>7}"
             f"{'busbw (GB/s)':>14}{'link use':>10}"]
    for row in payload["rows"]:
        t, sent = Spread.from_dict(row["time_s"]), Spread.from_dict(row["sent_bytes"]).scaled(1e-6)
        lines.append(f"{row['contender']:<32}{t.fmt(3):<24}{sent.fmt(2):<22}{row['formula_bytes'] / 1e6:<14.2f}"
                     f"{row['bytes_error']:>+7.1%}{row['busbw_Bps'] / 1e9:>14.3f}{row['link_utilization']:>10.0%}")
    ratios = speedups(payload)
    k, h = c["hosts"] * c["workers_per_host"], c["hosts"]
    ceiling = (k - 1) / k * h / (h - 1)
    lines.append("hierarchical vs flat: " + ", ".join(f"{kind} {ratio:.2f}x" for kind, ratio in ratios.items())
                 + f" (bytes per link bound it at {ceiling:.2f}x)")
    lines.append(f"first line: {payload['first_line']}")
    return "\n".join(lines)


def plot_hosts(payload: dict[str, Any]):
    """Time per contender (median, min-max whiskers) beside bytes per link against the formula."""
    fig, (time_ax, bytes_ax) = new_figure(2, width_per_plot=6.0)
    rows = payload["rows"]
    names = [row["contender"] for row in rows]
    medians = [row["time_s"]["median"] for row in rows]
    whiskers = [[m - row["time_s"]["min"] for m, row in zip(medians, rows)],
                [row["time_s"]["max"] - m for m, row in zip(medians, rows)]]
    time_ax.barh(names, medians, xerr=whiskers, color=["gray" if "flat" in n else "tab:blue" for n in names])
    time_ax.set_xlabel("seconds per allreduce / step")
    bytes_ax.barh(names, [row["sent_bytes"]["median"] / 1e6 for row in rows], label="measured (tx_bytes)")
    bytes_ax.scatter([row["formula_bytes"] / 1e6 for row in rows], names, color="black", marker="|", s=300,
                     label="formula", zorder=3)
    bytes_ax.set_xlabel("MB sent per host link")
    bytes_ax.legend(fontsize=7)
    for ax in (time_ax, bytes_ax):
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle(f"{payload['config']['hosts']} hosts x {payload['config']['workers_per_host']} workers, "
                 f"{payload['config']['link_gbit']:g} Gbit/s links", fontsize=9)
    fig.tight_layout()
    return fig


__all__ = ["HostsBenchConfig", "formula_bytes", "plot_hosts", "report_hosts",
           "require_bed", "run_hosts_bench", "speedups", "summarize"]
