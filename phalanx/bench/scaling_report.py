"""The terminal table and the chart of `phalanx bench scaling` (the measurement is scaling.py).

Per global batch size: images/s of every contender (median, min-max over interleaved rounds, or
over every block of a side-by-side run) with its process set-up, then each ratio phalanx is
judged by (median of per-round, or per-block, ratios); side by side, where each contender's step
went, phase by phase, and what phalanx/k spent beyond its lockstep twin. The chart draws the same
images/s as bars with min-max whiskers, phalanx's in blue.
"""

from __future__ import annotations

import statistics
from typing import Any

from phalanx.measure.load import DISTURBED_CORES
from phalanx.measure.outputs import format_table, median_whiskers, panels_by_batch, rows_by_batch
from phalanx.measure.timing import Spread


def report_scaling(payload: dict[str, Any]) -> str:
    variants_by_name = {v["name"]: v for v in payload["variants"]}
    settings = ", ".join(f"{k}={v}" for k, v in payload["phalanx_data_parallel"].items())
    lines = [f"phalanx ran DataParallel({settings}); DDP its defaults", *_load_lines(payload), ""]
    for batch, results in rows_by_batch(payload["results"], payload["config"]["global_batch_sizes"]):
        rows = []
        for r in results:
            v = variants_by_name[r["variant"]]
            setup = f"{v['num_procs']} x {v['threads_per_proc']} thr" + (", alloc env" if v["allocator_env"] else "")
            setup += ", NHWC" if v.get("memory_format", "contiguous") != "contiguous" and payload["config"]["model"] != "mlp" else ""
            rows.append((r["variant"], setup, Spread.from_dict(r["images_per_s"]).fmt(0)))
        config = payload["config"]
        if payload.get("method") == "side by side":
            starts = f"{config['rounds']} start{'s' if config['rounds'] != 1 else ''}"
            how = (f"{starts} x {config['blocks']} blocks side by side, {config['steps']} timed "
                   "steps each; ratios: median (quartiles) of per-block ratios")
        else:
            how = f"{config['rounds']} interleaved rounds, {config['steps']} timed steps each"
        lines.append(f"{config['model']}, global batch {batch}: images/s, median (min-max) of {how}")
        lines += [format_table(["configuration", "processes", "images/s"], rows), ""]
        for r in (r for r in payload["ratios"] if r["global_batch_size"] == batch):
            label = f"{r.get('numerator', 'phalanx/' + str(r['num_devices']))} / {r['against']}"
            lines.append(f"  {r['metric']:<42} {label:<36} {_ratio_text(r['ratio'], payload.get('method'))}")
        lines += [*_phase_lines(payload, batch), ""]
    return "\n".join(lines).rstrip()


def _phase_lines(payload: dict[str, Any], batch: int) -> list[str]:
    """Side by side: where each contender's step went at `batch` (measure/phases.py), and what of
    phalanx/k's step its lockstep twin did not spend, phase by phase."""
    rows = [r for r in payload.get("phases", ()) if r["global_batch_size"] == batch]
    if not rows:
        return []
    by_name: dict[str, list[dict[str, float]]] = {}
    for r in rows:
        by_name.setdefault(r["variant"], []).append(r["ms_per_step"])
    phases = list(rows[0]["ms_per_step"])  # in their order
    ms = {name: {phase: statistics.median(start[phase] for start in starts) for phase in phases}
          for name, starts in by_name.items()}
    table = [(name, *(f"{ms[name][p]:.2f}" for p in phases), f"{sum(ms[name].values()):.2f}") for name in ms]
    lines = ["", "  where a step went, ms per step (each start: the ranks' mean, the median of its blocks; the "
             "median of starts); lockstep's wait is its meeting, DDP's exchange is inside its backward",
             *("  " + line for line in format_table(["contender", *phases, "step"], table).splitlines())]
    k = max(payload["config"]["device_counts"])
    ours, twin = ms.get(f"phalanx/{k}"), ms.get(f"ceiling/{k} lockstep")
    if ours is not None and twin is not None:
        extra = ", ".join(f"{p} {ours[p] - twin[p]:+.2f}" for p in phases)
        lines.append(f"  phalanx/{k} beyond its lockstep twin: {sum(ours.values()) - sum(twin.values()):+.2f} ms a "
                     f"step ({extra})")
    return lines


def _load_lines(payload: dict[str, Any]) -> list[str]:
    """What other programs took meanwhile (measure/load.py): on a shared machine each contender
    lost a different share of the cores, so a ratio can be off by more than its spread - an
    efficiency above 1, phalanx above its no-communication ceiling."""
    others = payload.get("others_cores")
    if others is None:
        return []
    line = f"other processes kept {others:.1f} of the {payload['cores']} cores busy meanwhile"
    stolen = payload.get("stolen_cores")
    if stolen is not None and stolen >= 0.05:  # a VM's hypervisor ran other guests on its CPUs
        line += f" ({stolen:.1f} of them stolen by the hypervisor for other virtual machines)"
    if others < DISTURBED_CORES:
        return [line]
    return [f"{line}: disturbed - each contender lost a different share of the cores to them, so a ratio may be "
            "off by more than its spread (a scaling efficiency above 1, phalanx above its ceiling: that load, not "
            "phalanx); rerun on a quiet machine"]


def _ratio_text(ratio: dict[str, Any], method: str | None) -> str:
    """A ratio as the table prints it: median (min-max) over rounds; side by side, where a ratio
    has a sample per block, median (first-third quartile), which one odd block does not move."""
    spread = Spread.from_dict(ratio)
    if method != "side by side" or len(spread.samples) < 2:
        return spread.fmt(2)
    q1, _, q3 = statistics.quantiles(spread.samples, n=4)
    return f"{spread.median:.2f} ({q1:.2f}-{q3:.2f})"


def plot_scaling(payload: dict[str, Any]):
    """Images/s per configuration (bars at the median, whiskers at min and max), one panel per batch."""
    fig, panels = panels_by_batch(payload["results"], payload["config"]["global_batch_sizes"], width_per_plot=5.5)
    for ax, batch, rows in panels:
        names = [r["variant"] for r in rows]
        med, err = median_whiskers(rows, "images_per_s")
        colors = ["tab:blue" if n.startswith("phalanx") else "tab:gray" for n in names]
        ax.barh(names, med, xerr=err, color=colors, capsize=3)
        ax.invert_yaxis()
        ax.set_xlabel("images/s")
        ax.set_title(f"{payload['config']['model']}, global batch {batch}", fontsize=9)
        ax.grid(alpha=0.3, axis="x")
    return fig
