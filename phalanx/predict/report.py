"""The prediction as a terminal table and a chart (images/s against k, measured points beside).

Figures are medians over rounds (min-max in the JSON). Columns: k; each device's shard and
threads; compute (the slowest rank's forward + backward + optimizer); the buckets' allreduce
time; the share of it that hid behind backward; the exposed wait; the step; images/s, speedup
over one device and scaling efficiency (speedup / k); with validation, the measured images/s
and the error (predicted / measured - 1), also against the prediction for the other load the
measurement met.

A profile is a timing on a machine others may share, so the report says when it was disturbed:
one line when other programs took a fifth of a core or more that the profiled device needed
(profile.py notes their busy time; on a busy 2-core box k = 1 was profiled beside another
program's load and k = 2 without it, and the table printed speedup 4.79, eff 240% without a word).
An efficiency above 100% is marked and explained in a line below its table: a k = 1 profile that
met more load than k's, or a shard that computes faster per image than the whole batch.
"""

from __future__ import annotations

from typing import Any

from phalanx.measure.outputs import format_table, median_whiskers, panels_by_batch, rows_by_batch
from phalanx.measure.timing import Spread


def _med(row: dict[str, Any], key: str) -> float:
    return row[key]["median"]


def _link_line(payload: dict[str, Any]) -> str:
    link = payload["rounds"][-1]["link"]
    alphas = [r["link"]["alpha_s"] * 1e6 for r in payload["rounds"]]
    betas = [r["link"]["beta_Bps"] / 1e9 for r in payload["rounds"]]
    etas = [r["link"]["overlap_efficiency"] for r in payload["rounds"]]
    how = "measured, 2-process sweep" if link["source"] == "measured" else "given"
    fit = f", fit within {link['fit_max_rel_error']:.0%}" if "fit_max_rel_error" in link else ""
    return (f"link {payload['predict']['interconnect']['name']} ({how}{fit}): alpha {Spread.of(alphas).median:.1f} us, "
            f"beta {Spread.of(betas).median:.2f} GB/s, overlap efficiency {Spread.of(etas).median:.2f}")


DISTURBED_CORES = 0.2  # other programs' share of the cores a profile needed, from which it is named


def _taken(row: dict[str, Any], cores: int) -> float:
    """Cores other programs took (worst round) from the ones this k's profile wanted."""
    others, ours = row["profile_others_busy_cores"]["max"], row["co_runners"] * row["threads"]
    return max(0.0, min(others, ours + others - cores))


def _load_notes(rows: list[dict[str, Any]], base: dict[str, Any] | None, cores: int) -> tuple[set[int], list[str]]:
    """The k whose efficiency is above 100%, and the lines that say why and whether the profile was disturbed."""
    lines = []
    if any(_taken(r, cores) >= DISTURBED_CORES for r in rows):
        busy = ", ".join(f"k = {r['world_size']}: {r['profile_others_busy_cores']['max']:.1f}" for r in rows)
        lines.append(f"profile disturbed: other programs kept cores busy while it ran ({busy} of {cores} cores, the "
                     "worst round); the figures built on it are not this machine's alone - rerun when it is quieter")
    above = {r["world_size"] for r in rows if base is not None  # as printed: 100.4% reads 100%, no word needed
             and round(100 * _med(r, "images_per_s") / _med(base, "images_per_s") / r["world_size"]) > 100}
    for r in (r for r in rows if r["world_size"] in above):
        k = r["world_size"]
        if _taken(base, cores) - _taken(r, cores) >= DISTURBED_CORES:
            why = (f"one device's profile met more of other programs' load "
                   f"({base['profile_others_busy_cores']['max']:.1f} cores) than k = {k}'s "
                   f"({r['profile_others_busy_cores']['max']:.1f}), so k = 1 looks slower than it is")
        else:
            one, each = _med(base, "compute_s"), _med(r, "compute_s")
            gain = one / base["batch_size_per_device"] / (each / r["batch_size_per_device"])
            why = (f"each device computes its {r['batch_size_per_device']} images in {each * 1e3:.1f} ms, one device "
                   f"its {base['batch_size_per_device']} in {one * 1e3:.1f} ms: {gain:.2f}x faster per image (a "
                   "smaller batch fits the caches, fewer threads wait less on each other); the profile's gain, "
                   "not a measurement (--validate measures it)")
        lines.append(f"* eff above 100% at k = {k}: {why}")
    return above, lines


def _exchange_line(payload: dict[str, Any]) -> str:
    """Where each k's exchange runs, as training will run it (the profile and the timeline follow)."""
    by_overlap: dict[bool, list[int]] = {}
    for row in payload["summary"]:  # a row per (batch, k): each k once
        ks = by_overlap.setdefault(row["overlap"], [])
        if row["world_size"] not in ks:
            ks.append(row["world_size"])
    given = payload["predict"].get("overlap")
    how = "as given" if given is not None else "overlap auto, as training picks it"
    parts = [("beside backward, bucket by bucket" if overlapped else "after backward, one flat bucket")
             + ("" if len(by_overlap) == 1 else f" at k = {', '.join(map(str, ks))}")
             for overlapped, ks in sorted(by_overlap.items(), reverse=True)]
    return f"exchange: {'; '.join(parts)} ({how})"


def report_prediction(payload: dict[str, Any]) -> str:
    config = payload["predict"]
    cap = config["bucket_cap_mb"]
    lines = [f"phalanx predict: {config['model']}, {config['algorithm']} allreduce, bucket cap "
             f"{'none' if cap is None else f'{cap:g} MB'}, {payload['cores']} cores here, "
             f"median of {config['rounds']} round{'s' if config['rounds'] > 1 else ''}",
             _link_line(payload), _exchange_line(payload), ""]
    for batch, rows in rows_by_batch(payload["summary"], config["global_batch_sizes"]):
        base = next((r for r in rows if r["world_size"] == 1), None)
        above, notes = _load_notes(rows, base, payload["cores"])
        table = []
        for r in rows:
            ips = _med(r, "images_per_s")
            speedup = "" if base is None else f"{ips / _med(base, 'images_per_s'):.2f}"
            eff = "" if base is None else f"{ips / _med(base, 'images_per_s') / r['world_size']:.0%}"
            eff += "*" if r["world_size"] in above else ""
            cells = [r["world_size"], f"{r['batch_size_per_device']} x {r['threads']}",
                     f"{_med(r, 'compute_s') * 1e3:.1f}", f"{_med(r, 'comm_s') * 1e3:.1f}",
                     f"{_med(r, 'hidden_fraction'):.0%}", f"{_med(r, 'exposed_s') * 1e3:.1f}",
                     f"{_med(r, 'step_s') * 1e3:.1f}", f"{ips:.0f}", speedup, eff]
            if payload["validated_world_sizes"]:
                measured = r.get("measured_images_per_s")
                cells += [Spread.from_dict(measured).fmt(0) if measured else "-",
                          f"{_med(r, 'error'):+.1%}" if measured else "-",
                          f"{_med(r, 'error_at_its_load'):+.1%}" if measured else "-"]
            table.append(cells)
        headers = ["k", "batch x thr", "compute ms", "allreduce ms", "hidden", "exposed ms", "step ms",
                   "images/s", "speedup", "eff"]
        if payload["validated_world_sizes"]:
            headers += ["measured images/s", "error", "at its load"]
        lines.append(f"global batch {batch}:")
        lines += [format_table(headers, table), *notes, ""]
    if payload["validated_world_sizes"]:
        lines += ["measured: phalanx on k CPU workers here, as bench scaling runs it; error: predicted / measured - 1",
                  "per round (median); at its load: the prediction redone for the other programs' load that the",
                  "measurement met (this machine's cores are shared)"]
    return "\n".join(lines).rstrip()


def plot_prediction(payload: dict[str, Any]):
    """Images/s against k per global batch: prediction (line), linear scaling, measurements."""
    fig, panels = panels_by_batch(payload["summary"], payload["predict"]["global_batch_sizes"], width_per_plot=5.0)
    for ax, batch, rows in panels:
        ks = [r["world_size"] for r in rows]
        ips = [_med(r, "images_per_s") for r in rows]
        ax.plot(ks, ips, marker="o", label="predicted")
        ax.fill_between(ks, [r["images_per_s"]["min"] for r in rows], [r["images_per_s"]["max"] for r in rows],
                        alpha=0.2)
        one = next((r for r in rows if r["world_size"] == 1), None)
        if one is not None:
            ax.plot(ks, [k * _med(one, "images_per_s") for k in ks], linestyle="--", color="gray",
                    label="linear from k = 1")
        measured = [r for r in rows if "measured_images_per_s" in r]
        if measured:
            med, err = median_whiskers(measured, "measured_images_per_s")
            ax.errorbar([r["world_size"] for r in measured], med, yerr=err, fmt="s", color="tab:red",
                        capsize=3, label="measured (phalanx)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel("devices k")
        ax.set_ylabel("images/s")
        ax.set_title(f"{payload['predict']['model']}, global batch {batch}, "
                     f"{payload['predict']['interconnect']['name']}", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    return fig
