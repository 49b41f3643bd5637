"""The terminal table and the chart of `phalanx bench memory` (the measurement is memory.py).

Per model: one row per contender - MB of parameters, gradients and optimizer state held by the
fullest rank, the fullest worker's resident set before the model, its peak over the set-up,
after the first 5 steps and over the whole run (median; min-max for the whole run: a peak that
grows with the steps shows as the gap between the last two), and the step time (median, min-max over
interleaved rounds) - then the comparisons: held bytes as one number, peak RSS and step speed as
medians (min-max) of per-round ratios. The chart stacks each contender's held MB and marks
its peak RSS above the process's own (what the model and its training added).
"""

from __future__ import annotations

from typing import Any

from phalanx.measure.memory import EARLY_STEPS, HELD
from phalanx.measure.outputs import format_table, new_figure
from phalanx.measure.timing import Spread

MB = 1e6
SHORT = {"ddp": "DDP", "zero": "ZeroRedundancyOptimizer", "fsdp2": "FSDP2", "none": "phalanx none",
         "optimizer": "phalanx optimizer", "gradients": "phalanx gradients", "parameters": "phalanx parameters"}
WHAT = {"optimizer_state_bytes": "optimizer-state bytes", "gradients_bytes": "gradient bytes",
        "parameters_bytes": "parameter bytes", "peak_rss": "peak RSS", "step_speed": "step speed (1 / step time)"}


def _mb(spread: dict | None, *, with_range: bool = False) -> str:
    if spread is None:
        return "-"
    value = Spread.from_dict(spread).scaled(1 / MB)
    return value.fmt(0) if with_range else f"{value.median:.0f}"


def ratio_label(ratio: dict[str, Any]) -> str:
    """'phalanx optimizer / none' (a stage over phalanx's none) or 'phalanx parameters / FSDP2'."""
    top, bottom = SHORT[ratio["numerator"]], SHORT[ratio["against"]]
    if top.startswith("phalanx ") and bottom.startswith("phalanx "):
        bottom = bottom.removeprefix("phalanx ")
    return f"{top} / {bottom}"


def ratio_value(ratio: dict[str, Any]) -> str:
    value = ratio["ratio"]
    return f"{value:.2f}" if isinstance(value, float) else Spread.from_dict(value).fmt(2)


def report_memory(payload: dict[str, Any]) -> str:
    config = payload["config"]
    threads = next(iter(payload["variants"].values()))["threads_per_proc"]
    lines = [f"every contender: {threads} thread(s) per process, contiguous weights, BatchNorm on each rank's own "
             f"batch; allocator: {payload['allocator']}", ""]
    for model in config["models"]:
        rows = [r for r in payload["results"] if r["model"] == model]
        count = rows[0]["num_parameters"]
        lines.append(f"{model}: {count / 1e6:.1f} M parameters ({4 * count / MB:.0f} MB float32), "
                     f"{config['optimizer']}, k={config['num_devices']}, global batch {config['global_batch_size']}; "
                     f"MB held by the fullest rank; RSS of the fullest worker and step time: median (min-max) of "
                     f"{config['rounds']} interleaved rounds, {config['steps']} timed steps each")
        table = [(r["name"], *(f"{r['held_bytes'][part] / MB:.1f}" for part in HELD),
                  _mb(r["rss_before_model_bytes"]), _mb(r.get("setup_peak_rss_bytes")),
                  _mb(r.get("early_steps_peak_rss_bytes")), _mb(r["peak_rss_bytes"], with_range=True),
                  Spread.from_dict(r["step_s"]).scaled(1e3).fmt(0))
                 for r in rows]
        lines += [format_table(["contender", "params MB", "grads MB", "optim state MB", "RSS before model MB",
                                "set-up peak MB", f"peak after {EARLY_STEPS} steps MB", "peak RSS MB", "step ms"],
                               table), ""]
        named = [(f"{ratio_label(r)} {WHAT[r['metric']]}:", ratio_value(r)) for r in payload["ratios"]
                 if r["model"] == model]
        width = max((len(label) for label, _ in named), default=0)
        lines += [f"  {label:<{width}}  {value}" for label, value in named]
        lines.append("")
    return "\n".join(lines).rstrip()


def plot_memory(payload: dict[str, Any]):
    """Per model, each contender's held MB stacked (parameters, gradients, optimizer state), and
    its peak RSS above the RSS before the model as a black mark, with its step time beside it."""
    models = payload["config"]["models"]
    fig, axes = new_figure(len(models), width_per_plot=4.5, height=0.4 * len(payload["variants"]) + 1.8)
    for ax, model in zip(axes, models):
        rows = [r for r in payload["results"] if r["model"] == model]
        left = [0.0] * len(rows)
        for part, color in zip(HELD, ("tab:blue", "tab:orange", "tab:green")):
            widths = [r["held_bytes"][part] / MB for r in rows]
            ax.barh(range(len(rows)), widths, left=left, color=color, label=part.replace("_", " "))
            left = [a + b for a, b in zip(left, widths)]
        for i, r in enumerate(rows):
            end = left[i]
            if r["peak_rss_bytes"] is not None and r["rss_before_model_bytes"] is not None:
                end = (r["peak_rss_bytes"]["median"] - r["rss_before_model_bytes"]["median"]) / MB
                ax.scatter([end], [i], color="black", marker="|", s=150, zorder=3,
                           label="peak RSS - RSS before model" if i == 0 else None)
            ax.annotate(f"{Spread.from_dict(r['step_s']).median * 1e3:.0f} ms", (max(end, left[i]), i),
                        xytext=(6, 0), textcoords="offset points", va="center", fontsize=7)
        ax.set_yticks(range(len(rows)), [r["name"] for r in rows] if ax is axes[0] else [])
        ax.invert_yaxis()
        ax.margins(x=0.25)
        ax.set_xlabel("MB per rank (the fullest)")
        ax.set_title(f"{model}, k={payload['config']['num_devices']}, {payload['config']['optimizer']}", fontsize=9)
        ax.grid(alpha=0.3, axis="x")
    axes[0].legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, frameon=False)
    return fig
