"""Experiment 4: a profiler trace of every experiment, and a picture of it.

D2L's exercise 4 says: use a profiler to verify that the code is efficient. `bench autopar
--trace DIR` runs one extra, untimed round of each experiment under `torch.profiler` (CPU
activity, plus CUDA on a GPU) with every thread recorded, and writes `DIR/exp<k>.json` in the
Chrome trace format `train --trace` uses (open it in https://ui.perfetto.dev or
chrome://tracing). `label(name)` marks a task or a stage so it can be found there. Whether work
ran at the same time is then visible: bars on different thread (or stream) rows that overlap in
time. `render_timeline` draws exactly that from a trace file, one row per thread or stream, as a
small PNG (`DIR/exp<k>.png`), so the answer can be seen without a trace viewer.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from phalanx.atomic import atomic_write_bytes

# Event categories drawn: our labels tall, the operators under them thin (Kineto's names).
_LABELS = ("user_annotation", "gpu_user_annotation")
_OPS = ("cpu_op", "kernel", "gpu_memcpy", "gpu_memset")
_GPU = ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")  # on a GPU's row: pid = device, tid = stream


def label(name: str):
    """`with label("compute 3"):` names a stretch of work in the trace (cheap when not profiling)."""
    return record_function(name)


def every_thread():
    """The profiler's setting that records every thread: without it only the thread that starts
    the profiler is recorded, and the point is to see the other threads (lanes) work beside it.
    torch added it in 2.7; an older torch is a ValueError naming that and the way out."""
    from torch._C._profiler import _ExperimentalConfig

    try:
        return _ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        raise ValueError(f"--trace needs a torch whose profiler records every thread (profile_all_threads, torch 2.7 "
                         f"or later), and this is torch {torch.__version__}: upgrade torch, or run without "
                         "--trace") from None


def records_every_thread() -> bool:
    """Whether this torch's profiler can record every thread (`every_thread` answers, not refuses)."""
    try:
        every_thread()
    except ValueError:
        return False
    return True


@contextlib.contextmanager
def profiled(trace_dir: str | None, name: str, *, cuda: bool = False) -> Iterator[None]:
    """Profile the block into `trace_dir/name.json` (and its picture `name.png`); nothing if None."""
    if trace_dir is None:
        yield
        return
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, experimental_config=every_thread()) as prof:
        yield
    path = Path(trace_dir) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    write_timeline_png(path, path.with_suffix(".png"), title=name)


def merge_traces(paths, out_path: str | Path) -> Path:
    """One trace (and picture) of several processes' traces; their timestamps share one clock."""
    events: list[dict[str, Any]] = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        events += data["traceEvents"] if isinstance(data, dict) else data
    out = Path(out_path)
    atomic_write_bytes(out, json.dumps({"traceEvents": events}).encode())
    write_timeline_png(out, out.with_suffix(".png"), title=out.stem)
    return out


def _events(trace_path: str | Path) -> list[dict[str, Any]]:
    data = json.loads(Path(trace_path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in _LABELS + _OPS and "dur" in e]


def timeline_rows(trace_path: str | Path) -> dict[str, list[dict[str, Any]]]:
    """The drawn events by row ("pid/tid"), each with start/end in ms from the first event."""
    events = _events(trace_path)
    if not events:
        return {}
    t0 = min(float(e["ts"]) for e in events)
    rows: dict[str, list[dict[str, Any]]] = {}
    for e in sorted(events, key=lambda e: float(e["ts"])):
        start_ms = (float(e["ts"]) - t0) / 1e3
        rows.setdefault(f"{e.get('pid')}/{e.get('tid')}", []).append(
            # Backends annotate their own calls too ("gloo:send"): drawn thin, like operators.
            {"name": e["name"], "label": e["cat"] in _LABELS and ":" not in e["name"], "start_ms": start_ms,
             "end_ms": start_ms + float(e["dur"]) / 1e3, "gpu": e["cat"] in _GPU})
    # Rows that hold our labels first (the lanes), in order of their first event.
    return dict(sorted(rows.items(), key=lambda kv: (not any(x["label"] for x in kv[1]), kv[1][0]["start_ms"])))


def row_name(key: str, events: list[dict[str, Any]]) -> str:
    """A row is named after the lane(s) its labels carry ("fwd1 d0 s0 @device0"), else its thread."""
    lanes = list(dict.fromkeys(e["name"].rsplit(" @", 1)[1] for e in events if e["label"] and " @" in e["name"]))
    if len(lanes) == 1:
        return lanes[0]
    if lanes:
        return "one thread: " + "+".join(lanes[:3])
    pid, tid = key.split("/")[0], key.split("/")[-1]
    if any(e.get("gpu") for e in events):
        return f"GPU {pid} stream {tid}"
    return f"thread {tid}"


def render_timeline(trace_path: str | Path, *, title: str = "", max_rows: int = 8):
    """A matplotlib figure: one row per thread/stream, labels as coloured bars, operators thin."""
    from phalanx.measure.outputs import new_figure

    rows = list(timeline_rows(trace_path).items())[:max_rows]
    fig, (ax,) = new_figure(1, width_per_plot=8.0, height=0.5 + 0.45 * max(1, len(rows)))
    colours: dict[str, str] = {}
    import matplotlib

    palette = [matplotlib.colormaps["tab20"](i) for i in range(20)]
    for y, (_, events) in enumerate(rows):
        for event in events:
            width = event["end_ms"] - event["start_ms"]
            if event["label"]:
                kind = event["name"].split(" ")[0]  # "fwd1 d0 s2" and "fwd1 d1 s2" share a colour
                first = kind not in colours
                colour = colours.setdefault(kind, palette[len(colours) % len(palette)])
                ax.barh(y, width, left=event["start_ms"], height=0.6, color=colour, alpha=0.85,
                        label=kind if first else None)
            else:
                ax.barh(y - 0.38, width, left=event["start_ms"], height=0.12, color="0.4")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([row_name(key, events) for key, events in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms", fontsize=8)
    ax.set_title(title or Path(trace_path).stem, fontsize=9)
    if colours:
        ax.legend(fontsize=6, ncol=min(8, len(colours)), loc="upper center",
                  bbox_to_anchor=(0.5, -0.35 / len(rows) - 0.25), frameon=False)
    ax.grid(alpha=0.3, axis="x")
    return fig


def write_timeline_png(trace_path: str | Path, png_path: str | Path, *, title: str = "") -> Path:
    """Render `trace_path` and write the PNG atomically."""
    import io

    import matplotlib.pyplot as plt

    fig = render_timeline(trace_path, title=title)
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    atomic_write_bytes(Path(png_path), buffer.getvalue())
    return Path(png_path)
