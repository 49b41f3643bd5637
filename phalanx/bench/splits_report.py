"""The terminal table and the chart of `phalanx bench splits` (the measurement is splits.py).

One row per (split, k): bytes sent per step by the busiest device, counted by the transport,
beside the formula's number for that device; the median step time (min-max); the idle share
(mean over devices; for layers with GPipe's (k-1)/(M+k-1) beside it); parameters and peak
activation memory held by the fullest device. The chart shows the same five quantities as
grouped bars, one group per k.
"""

from __future__ import annotations

from phalanx.measure.outputs import format_table, new_figure


def _kb(size_bytes: float) -> str:
    return f"{size_bytes / 1024:.1f}"


def report_splits(payload: dict) -> str:
    headers = ["split", "k", "sent KB/device", "formula KB", "step ms (min-max)", "idle share", "GPipe bubble",
               "params/device", "activations KB/device"]
    rows = []
    for row in payload["rows"]:
        busiest = max(range(row["k"]), key=lambda r: row["sent_bytes_per_device"][r])
        split = row["split"] + (f" (M={row['micro_batches']})" if row["micro_batches"] else "")
        rows.append([split, row["k"], _kb(row["sent_bytes_per_device"][busiest]),
                     _kb(row["formula_bytes_per_device"][busiest]),
                     f"{row['step_s_median'] * 1e3:.1f} ({row['step_s_min'] * 1e3:.1f}-{row['step_s_max'] * 1e3:.1f})",
                     f"{sum(row['idle_share_per_device']) / row['k']:.2f}",
                     "" if row["bubble_gpipe"] is None else f"{row['bubble_gpipe']:.2f}",
                     max(row["parameters_per_device"]), _kb(max(row["activation_bytes_per_device"]))])
    config = payload["config"]
    return (f"LeNet, global batch {config['global_batch_size']}, {config['dtype']}, per step; the busiest device's "
            f"bytes, the fullest device's memory; every split sends through a counting transport over gloo's "
            f"point-to-point (data: the ring allreduce, one bucket, no overlap), so its step is slower than "
            f"`phalanx train`'s, which sums through shared memory\n" + format_table(headers, rows))


def plot_splits(payload: dict):
    metrics = [("sent KB / device / step", lambda r: max(r["sent_bytes_per_device"]) / 1024),
               ("step time (ms)", lambda r: r["step_s_median"] * 1e3),
               ("idle share", lambda r: sum(r["idle_share_per_device"]) / r["k"]),
               ("parameters / device", lambda r: max(r["parameters_per_device"])),
               ("activations KB / device", lambda r: max(r["activation_bytes_per_device"]) / 1024)]
    fig, axes = new_figure(len(metrics), width_per_plot=3.6, height=3.4)
    splits = list(dict.fromkeys(r["split"] for r in payload["rows"]))
    ks = list(dict.fromkeys(r["k"] for r in payload["rows"]))
    width = 0.8 / len(splits)
    for ax, (title, value) in zip(axes, metrics):
        for i, split in enumerate(splits):
            rows = [next(r for r in payload["rows"] if r["split"] == split and r["k"] == k) for k in ks]
            ax.bar([j + i * width for j in range(len(ks))], [value(r) for r in rows], width, label=split)
        ax.set_xticks([j + width * (len(splits) - 1) / 2 for j in range(len(ks))], [f"k={k}" for k in ks])
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=8)
    fig.suptitle("LeNet split three ways (phalanx bench splits)", fontsize=10)
    return fig
