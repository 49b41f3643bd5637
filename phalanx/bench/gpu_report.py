"""The terminal table and the chart of `phalanx bench gpu` (the measurement is gpu.py).

Images/s of every contender (median, min-max over interleaved rounds), whether its captured step
replayed to the end, then the ratios it is judged by (medians of per-round ratios); the chart
draws images/s as bars with min-max whiskers, phalanx's in blue, the variants below the anchors.
"""

from __future__ import annotations

from typing import Any

from phalanx.measure.outputs import format_table, median_whiskers, new_figure
from phalanx.measure.timing import Spread


def report_gpu(payload: dict[str, Any]) -> str:
    config = payload["config"]
    lines = [f"{config['model']}, {config['num_images']} images resident, global batch {config['global_batch_size']}, "
             f"on {payload['where']}: images/s, median (min-max) of interleaved rounds, {config['epochs']} timed "
             "epochs each", ""]
    rows = [(r["contender"], r["group"], r["rounds"], Spread.from_dict(r["images_per_s"]).fmt(0),
             ", ".join(r["graph"]) or "-") for r in payload["results"]]
    lines += [format_table(["contender", "group", "rounds", "images/s", "graph"], rows), ""]
    for r in payload["ratios"]:
        lines.append(f"  {r['metric']:<44} {r['numerator'] + ' / ' + r['against']:<52} "
                     f"{Spread.from_dict(r['ratio']).fmt(2)}")
    check = payload["check"]
    if payload["rounds_skipped"]:
        lines += ["", f"not started within the {config['budget_s']:g} s budget: {len(payload['rounds_skipped'])} "
                      f"round(s) of {', '.join(sorted(set(payload['rounds_skipped'])))}"]
    lines += ["", f"check: every captured phalanx run replayed its graph ({payload['elapsed_s']:.0f} s in all): " +
              ("passed" if check["passed"] else "FAILED - " + "; ".join(check["problems"]))]
    return "\n".join(lines)


def plot_gpu(payload: dict[str, Any]):
    fig, (ax,) = new_figure(1, width_per_plot=7.0, height=0.35 * len(payload["results"]) + 1.2)
    names = [f"{r['contender']} ({r['group']})" if r["group"] != "anchors" else r["contender"]
             for r in payload["results"]]
    medians, whiskers = median_whiskers(payload["results"], "images_per_s")
    colors = ["tab:blue" if r["contender"].startswith("phalanx") else "tab:gray" for r in payload["results"]]
    ax.barh(names, medians, xerr=whiskers, color=colors, capsize=3)
    ax.invert_yaxis()
    ax.set_xlabel("images/s")
    ax.set_title(f"{payload['config']['model']}, batch {payload['config']['global_batch_size']}, {payload['where']}",
                 fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    return fig


__all__ = ["plot_gpu", "report_gpu"]
