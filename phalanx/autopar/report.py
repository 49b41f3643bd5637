"""The bookkeeping of `bench autopar`: outcome arithmetic, crossover, verdicts, table and chart.

Every experiment is reduced to the same outcome (`outcome`): the measured time of the concurrent
way, the time of the same work in sequence, the ideal (longest independent part, pipeline bound
or critical path), and three per-round ratios - speed-up (sequence / measured), ideal speed-up
(sequence / ideal) and share of the ideal reached (ideal / measured, 1.0 = the ideal). Ratios
are medians of per-round ratios (timing.py). Verdicts are one line in plain words, written only
from those numbers; `WIN` is how much faster counts as faster on a shared machine, `GOOD_SHARE`
how close to the ideal counts as reaching it. Nothing here measures anything.
"""

from __future__ import annotations

from typing import Any, Sequence

from phalanx.measure.load import DISTURBED_CORES
from phalanx.measure.outputs import format_table, new_figure
from phalanx.measure.timing import Spread, paired_ratio

WIN = 1.10  # a speed-up below this is within a shared machine's round-to-round noise
GOOD_SHARE = 0.8


def outcome(*, measured_s: Sequence[float], sequential_s: Sequence[float], ideal_s: Sequence[float]) -> dict[str, Any]:
    """The common record: the three times and the three per-round ratios, as spreads."""
    return {"measured_s": Spread.of(measured_s).to_dict(), "sequential_s": Spread.of(sequential_s).to_dict(),
            "ideal_s": Spread.of(ideal_s).to_dict(),
            "speedup": paired_ratio(sequential_s, measured_s).to_dict(),
            "ideal_speedup": paired_ratio(sequential_s, ideal_s).to_dict(),
            "share_of_ideal": paired_ratio(ideal_s, measured_s).to_dict()}


def _m(record: dict[str, Any], key: str) -> float:
    return float(record[key]["median"])


def _ms(record: dict[str, Any], key: str) -> str:
    return f"{1e3 * _m(record, key):.1f} ms"


def crossover(sizes: Sequence[int], speedups: Sequence[float], *, win: float = WIN) -> dict[str, Any]:
    """The size from which concurrency stops winning for good: the one after the largest size that
    won by `win`. `size` is None when it won at every size (the crossover lies above the sweep);
    `exceptions` are the sizes below the crossover that did not win (noise, or a dip) - fewer than
    the wins there, or there is no range that wins: kind "isolated", `wins` the sizes that did."""
    if len(sizes) != len(speedups) or not sizes:
        raise ValueError(f"need one speed-up per size, got {len(sizes)} sizes and {len(speedups)} speed-ups")
    if list(sizes) != sorted(sizes):
        raise ValueError(f"sizes must ascend, got {list(sizes)}")
    wins = [s >= win for s in speedups]
    if not any(wins):
        return {"size": sizes[0], "kind": "never wins", "win": win, "exceptions": []}
    last_win = len(wins) - 1 - wins[::-1].index(True)
    exceptions = [size for size, won in zip(sizes[:last_win], wins[:last_win]) if not won]
    if len(exceptions) * 2 >= last_win + 1:  # as many sizes below the last win lost as won: no range
        return {"size": None, "kind": "isolated", "win": win, "exceptions": [],
                "wins": [size for size, won in zip(sizes, wins) if won]}
    if last_win == len(sizes) - 1:
        return {"size": None, "kind": "wins everywhere", "win": win, "exceptions": exceptions}
    return {"size": sizes[last_win + 1], "kind": "crossover", "win": win, "exceptions": exceptions}


def verdict_independent(result: dict[str, Any], *, eager_over_alone: float | None, how: str,
                        asynchronous: bool, device_bound_s: float | None = None) -> str:
    """Experiment 1: does the framework overlap by itself, and what does explicit concurrency buy?

    `asynchronous`: eager launches return before the work is done (CUDA). On CPU an operator
    runs to completion before the next one starts, so eager cannot beat the sum of its parts
    except by noise; on a GPU it can, by hiding launch and synchronisation costs, which is still
    not running two products at once (one stream runs its kernels in order). `device_bound_s`:
    the time of all the products as one kernel where that, not the longest lane, is the ideal."""
    parts = []
    if eager_over_alone is not None:
        ratio = f"issued eagerly they took {eager_over_alone:.2f}x the sum of each product alone"
        if not asynchronous:
            off = abs(eager_over_alone - 1) > 0.1
            noise = " (off 1.00 by the machine's noise: CPU ops are synchronous)" if off else ""
            parts.append(f"not by itself: {ratio}{noise}, one after another")
        elif eager_over_alone >= 0.9:
            parts.append(f"not by itself: {ratio}, one after another")
        else:
            parts.append(f"{ratio}: asynchronous launches hide the gaps between products, but one stream "
                         "still runs them one after another")
    parts.append(_gain(result, how, device_bound_s=device_bound_s))
    return "; ".join(parts) + "."


def _gain(result: dict[str, Any], how: str, *, device_bound_s: float | None = None) -> str:
    speedup, ideal, share = _m(result, "speedup"), _m(result, "ideal_speedup"), _m(result, "share_of_ideal")
    head = f"{how}: {_ms(result, 'measured_s')} vs {_ms(result, 'sequential_s')}, {speedup:.2f}x"
    if ideal < WIN and device_bound_s is not None:
        return (f"{head}; little to gain here (ideal {ideal:.2f}x): all of them as one batched kernel take "
                f"{1e3 * device_bound_s:.1f} ms, so the work itself keeps the GPU busy and streams can only share it")
    if ideal < WIN:
        return (f"{head}; little to gain here (ideal {ideal:.2f}x: the longest independent part already takes "
                f"{1 / ideal:.0%} of the time in sequence)")
    word = "pays" if speedup >= WIN else "does not pay"
    return f"{head} - concurrency {word}, {share:.0%} of the ideal {ideal:.2f}x"


def verdict_sweep(cross: dict[str, Any], sizes: Sequence[int], speedups: Sequence[float], how: str) -> str:
    """Experiment 2: the crossover in words, with the speed-ups at the ends of the sweep."""
    ends = f"{speedups[0]:.2f}x at n={sizes[0]}, {speedups[-1]:.2f}x at n={sizes[-1]}"
    win = f"{cross['win']:.2f}x"
    but = ""
    if cross["exceptions"]:
        but = f", except at n={', '.join(map(str, cross['exceptions']))}"
    if cross["kind"] == "isolated":
        won = ", ".join(f"n={size} ({speedup:.2f}x)" for size, speedup in zip(sizes, speedups) if size in cross["wins"])
        rest = [speedup for size, speedup in zip(sizes, speedups) if size not in cross["wins"]]
        return (f"{how} wins by at least {win} only at {won}; at the other {len(rest)} sizes it gives "
                f"{min(rest):.2f}-{max(rest):.2f}x: isolated sizes, no range below a crossover.")
    if cross["kind"] == "crossover":
        return (f"{how} wins below n={cross['size']} (at least {win} faster{but}) and no longer from "
                f"n={cross['size']} on: the crossover ({ends}).")
    if cross["kind"] == "wins everywhere":
        return f"{how} wins at every size swept{but}: the crossover lies above n={sizes[-1]} ({ends})."
    return f"{how} never wins by {win}, so the crossover lies at or below n={sizes[0]} ({ends})."


def verdict_pipeline(result: dict[str, Any], *, stages_s: dict[str, float], chunks: int, cores: int | None) -> str:
    """Experiment 3: how much of the pipeline's ideal the overlap reached, and what bounds it."""
    slowest = max(stages_s, key=stages_s.__getitem__)
    text = (f"all three at once: {_gain(result, 'pipelined')}; the slowest stage is {slowest} "
            f"({1e3 * stages_s[slowest]:.2f} ms of {chunks} chunks)")
    if _m(result, "share_of_ideal") < GOOD_SHARE and cores is not None:
        text += (f"; the ideal gives each stage a processor of its own, here three stages (the transfer's "
                 f"copies included) share {cores} cores")
    return text + "."


def verdict_graph(result: dict[str, Any], *, rounds: Sequence[dict[str, float]], tasks: int,
                  all_cores_s: float | None, edges: int, check_passed: bool) -> str:
    """Experiment 5: share of the critical-path ideal, what stops it when short, and correctness."""
    share = _m(result, "share_of_ideal")
    text = f"the scheduler ran the {tasks}-task graph: {_gain(result, 'scheduled')}"
    if share >= GOOD_SHARE:
        text += f" (reaches at least {GOOD_SHARE:.0%} of the critical-path ideal)"
    else:
        slowdown = _median([r["task_slowdown"] for r in rounds])
        crowded = _median([r["ideal_side_by_side_s"] for r in rounds])
        measured = _m(result, "measured_s")
        text += (f"; what stops it: tasks ran {slowdown:.2f}x slower side by side than alone (the ideal with "
                 f"those durations is {1e3 * crowded:.1f} ms) and {1e3 * max(0.0, measured - crowded):.1f} ms "
                 "went between tasks")
    if all_cores_s is not None:
        text += f"; every op on every core in sequence took {1e3 * all_cores_s:.1f} ms"
    text += ("; results " + ("bitwise equal to the sequential run, all " if check_passed
                             else "DIFFER or a dependency broke, of ") + f"{edges} dependencies respected")
    return text + "."


def _median(values: Sequence[float]) -> float:
    return Spread.of(values).median


def verdict_line(exp: dict[str, Any]) -> str:
    """An experiment's verdict; students quote them, so one measured while other programs kept a
    share of the cores busy carries that."""
    others = exp.get("others_cores")
    disturbed = f" (measured while other processes kept {others:.1f} cores busy: a quiet machine may differ)" \
        if others is not None and others >= DISTURBED_CORES else ""
    return f"  verdict: {exp['verdict']}{disturbed}"


def report_autopar(payload: dict[str, Any]) -> str:
    """The terminal table: one block per experiment, its verdict and its check."""
    config = payload["config"]
    lines = [f"on {payload['where']}; ms, median (min-max) of {config['rounds']} interleaved rounds"]
    headers = ["", "measured", "in sequence", "ideal", "speed-up", "ideal speed-up", "share of ideal", "check"]
    for exp in payload["experiments"]:
        others = exp.get("others_cores")
        busy = f"; other processes kept {others:.1f} cores busy meanwhile" if others is not None else ""
        lines += ["", f"({exp['experiment']}) {exp['title']} [{exp['how']}{busy}]"]
        records = exp.get("sweep", [exp])
        rows = []
        for record in records:
            r = record["outcome"]
            rows.append([f"n={record['size']}" if "size" in record else "",
                         *(Spread.from_dict(r[k]).scaled(1e3).fmt(1)
                           for k in ("measured_s", "sequential_s", "ideal_s")),
                         *(Spread.from_dict(r[k]).fmt(2) for k in ("speedup", "ideal_speedup", "share_of_ideal")),
                         "ok" if record["check"]["passed"] else "FAILED"])
        lines.append(format_table(headers, rows))
        for name, spread in exp.get("references_s", {}).items():
            lines.append(f"  {name}: {Spread.from_dict(spread).scaled(1e3).fmt(1)} ms")
        lines.append(verdict_line(exp))
        lines.append(f"  check: {exp['check']['what']}: {'passed' if exp['check']['passed'] else 'FAILED'}")
    if payload.get("trace_dir"):
        lines += ["", f"traces (experiment 4): {payload['trace_dir']}/exp*.json, pictures exp*.png"]
    return "\n".join(lines)


def plot_autopar(payload: dict[str, Any]):
    """Bars per experiment (in sequence, measured, ideal); experiment 2 as speed-up against n."""
    experiments = payload["experiments"]
    fig, axes = new_figure(max(1, len(experiments)), width_per_plot=3.6, height=3.4)
    for ax, exp in zip(axes, experiments):
        if "sweep" in exp:
            sizes = [r["size"] for r in exp["sweep"]]
            ax.plot(sizes, [r["outcome"]["speedup"]["median"] for r in exp["sweep"]], "o-", label="speed-up")
            ax.plot(sizes, [r["outcome"]["ideal_speedup"]["median"] for r in exp["sweep"]], "--", color="0.5",
                    label="ideal")
            ax.axhline(1.0, color="black", lw=0.8)
            if exp["crossover"]["size"] is not None:
                size = exp["crossover"]["size"]
                ax.axvline(size, color="tab:red", ls=":", label=f"crossover n={size}")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("n (matrix side)")
            ax.set_ylabel("concurrent vs one by one (x)")
        else:
            r = exp["outcome"]
            names = ["in sequence", "measured", "ideal"]
            values = [1e3 * r[k]["median"] for k in ("sequential_s", "measured_s", "ideal_s")]
            ax.bar(names, values, color=["tab:gray", "tab:blue", "tab:green"])
            for name, spread in exp.get("references_s", {}).items():
                ax.axhline(1e3 * spread["median"], color="tab:orange", ls="--", lw=1, label=name)
            ax.set_ylabel("ms")
        ax.set_title(f"({exp['experiment']}) {exp['title']}", fontsize=8)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
    return fig
