"""A sweep's three outputs from its rows: the terminal table, sweep.csv / sweep.json, sweep.png.

The picture has two panels over the global batch k·b (log scale): final test accuracy, and
training time to the target accuracy. Colour is the lr rule, the marker the device count: points
of one colour at the same global batch but different k should coincide in accuracy (k devices
compute the 1-device step on the same global batch), while their time depends on k.
The kit writes them (phalanx/measure/outputs.py, atomically); nothing here trains or reads data.
"""

from __future__ import annotations

import csv
import io
from typing import Any, Sequence

from phalanx.measure.outputs import format_table as columns

CSV_FIELDS = ("num_devices", "batch_size_per_device", "global_batch_size", "lr_rule", "lr", "warmup_epochs",
              "final_test_acc", "best_test_acc", "time_to_target_s", "epochs_to_target", "sec_per_epoch", "dataset")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def oversubscription_note(rows: Sequence[dict[str, Any]], cores: int) -> str | None:
    crowded = sorted({r["num_devices"] for r in rows if r["num_devices"] > cores})
    if not crowded:
        return None
    ks = ", ".join(map(str, crowded))
    return (f"* k = {ks}: more worker processes than the {cores} CPU cores, which they share (oversubscribed): "
            "their times show what the method costs in steps and communication, not a speed-up")


def format_table(rows: Sequence[dict[str, Any]], *, target_acc: float, cores: int) -> str:
    headers = ("k", "b/device", "global", "lr rule", "lr", "warmup", "final acc", "best acc",
               f"time to {target_acc:g}", "s/epoch")
    cells = []
    for r in rows:
        reached = (f"{r['time_to_target_s']:.1f} s (ep {r['epochs_to_target']})"
                   if r["time_to_target_s"] is not None else "not reached")
        cells.append((f"{r['num_devices']}{'*' if r['num_devices'] > cores else ''}", r["batch_size_per_device"],
                      r["global_batch_size"], r["lr_rule"], f"{r['lr']:.4g}",
                      f"{r['warmup_epochs']:g} ep" if r["warmup_epochs"] else "-",
                      f"{r['final_test_acc']:.3f}", f"{r['best_test_acc']:.3f}", reached, f"{r['sec_per_epoch']:.2f}"))
    note = oversubscription_note(rows, cores)
    return "\n".join([columns(headers, cells, left_columns=0)] + ([note] if note else []))


def csv_bytes(rows: Sequence[dict[str, Any]]) -> bytes:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if row[k] is None else row[k] for k in CSV_FIELDS})
    return buffer.getvalue().encode()


def plot_sweep(rows: Sequence[dict[str, Any]], *, target_acc: float, epochs: int, title: str = ""):
    """The two-panel figure (not yet saved): accuracy and time to target over the global batch."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; must precede pyplot
    import matplotlib.pyplot as plt

    fig, (acc_ax, time_ax) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=100)
    rules = list(dict.fromkeys(r["lr_rule"] for r in rows))
    ks = sorted({r["num_devices"] for r in rows})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, rule in enumerate(rules):
        color = colors[index % len(colors)]
        series = [r for r in rows if r["lr_rule"] == rule]
        label = "lr × global/base, warmup" if rule == "scaled" else f"lr {rule}"
        for ax, key in ((acc_ax, "final_test_acc"), (time_ax, "time_to_target_s")):
            line = _mean_by_batch(series, key)
            ax.plot([b for b, _ in line], [v for _, v in line], color=color, alpha=0.6,
                    label=label if ax is acc_ax else None)
            for r in series:
                if r[key] is not None:
                    ax.scatter(r["global_batch_size"], r[key], color=color, marker=_marker(r["num_devices"], ks),
                               s=36, zorder=3)
    for k in ks:  # a legend entry per marker, in grey
        acc_ax.scatter([], [], color="grey", marker=_marker(k, ks), label=f"k = {k}")
    for ax in (acc_ax, time_ax):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("global batch k × b")
        ax.grid(alpha=0.3)
    acc_ax.set_ylabel(f"test accuracy after {epochs} epochs")
    acc_ax.axhline(target_acc, color="grey", linestyle=":", linewidth=1)
    if rows and rows[0].get("num_classes"):  # a diverged run ends at chance level
        chance = 1 / rows[0]["num_classes"]
        acc_ax.axhline(chance, color="grey", linestyle="--", linewidth=0.8)
        acc_ax.annotate("chance", (acc_ax.get_xlim()[0], chance), xytext=(4, 3), textcoords="offset points",
                        fontsize=7, color="grey")
    acc_ax.legend(fontsize=8, loc="center left")
    time_ax.set_ylabel(f"training seconds to test acc {target_acc:g}")
    time_ax.set_title(f"missing: not reached in {epochs} epochs", fontsize=8)
    if all(r["time_to_target_s"] is None for r in rows):  # say so, not an empty frame
        time_ax.text(0.5, 0.5, f"no point reached test acc {target_acc:g}\nin {epochs} epochs",
                     transform=time_ax.transAxes, ha="center", va="center", color="grey")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def _marker(k: int, ks: Sequence[int]) -> str:
    return MARKERS[list(ks).index(k) % len(MARKERS)]


def _mean_by_batch(series: Sequence[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """Per global batch, the mean over the device counts that reached a value (skip the others)."""
    groups: dict[int, list[float]] = {}
    for r in series:
        if r[key] is not None:
            groups.setdefault(r["global_batch_size"], []).append(r[key])
    return [(b, sum(v) / len(v)) for b, v in sorted(groups.items())]
