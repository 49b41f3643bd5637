"""What a measuring command leaves: a terminal table, and `<name>.json` + `<name>.png` in `--out`.

`prepare_out_dir` checks --out the one way every command does (`phalanx.outdir.check_out_dir`:
nothing measured, nothing written when it is unusable) and creates it; `write_outputs` writes the
JSON payload, any extra files (sweep's CSV) and the figure, each atomically, so a reader never
sees half a file. `format_table` draws plain aligned columns; `new_figure` opens a matplotlib
figure on the Agg backend; `rows_by_batch` / `panels_by_batch` give each global batch size its
own table and chart panel (bench scaling, predict); `median_whiskers` turns a column of spreads
into bar heights and min-max error bars.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from phalanx.atomic import atomic_write_bytes
from phalanx.outdir import check_out_dir


def prepare_out_dir(out_dir: str | os.PathLike, *, flag: str = "--out") -> Path:
    """Check --out (outdir.check_out_dir) and create it, before any measuring: a bad path costs nothing."""
    check_out_dir(out_dir, flag=flag)
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, left_columns: int = 1) -> str:
    """Plain aligned columns under a dashed rule: the first `left_columns` left-aligned, the rest
    right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for index, row in enumerate(cells):
        parts = [c.ljust(w) if i < left_columns else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(parts).rstrip())
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def new_figure(ncols: int = 1, *, width_per_plot: float = 5.0, height: float = 3.8, nrows: int = 1):
    """A matplotlib (fig, [axes]) on the Agg backend (no display on servers); with several rows
    the axes are listed row by row."""
    import matplotlib

    matplotlib.use("Agg")  # must precede pyplot
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=(width_per_plot * ncols, height * nrows), dpi=100, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def rows_by_batch(rows: Sequence[Mapping[str, Any]], batches: Sequence[int]) -> list[tuple[int, list]]:
    """(global batch size, the rows of that batch in their order) for each of `batches`: the
    scaling and predict reports give each global batch its own table and its own chart panel."""
    return [(batch, [r for r in rows if r["global_batch_size"] == batch]) for batch in batches]


def panels_by_batch(rows: Sequence[Mapping[str, Any]], batches: Sequence[int], *, width_per_plot: float):
    """A figure with one panel per global batch size: (fig, [(axes, batch, the rows of that batch)])."""
    fig, axes = new_figure(len(batches), width_per_plot=width_per_plot)
    return fig, [(ax, batch, batch_rows) for ax, (batch, batch_rows) in zip(axes, rows_by_batch(rows, batches))]


def median_whiskers(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[list[float]]]:
    """The medians of each row's spread `key` and matplotlib's error bars to its min and max."""
    medians = [r[key]["median"] for r in rows]
    return medians, [[m - r[key]["min"] for m, r in zip(medians, rows)],
                     [r[key]["max"] - m for m, r in zip(medians, rows)]]


def write_outputs(out_dir: Path, name: str, payload: Mapping[str, Any], fig, *,
                  also: Mapping[str, bytes] | None = None) -> tuple[Path, ...]:
    """Write `<name>.json`, `<name>.<suffix>` for each of `also` ({suffix: bytes}) and `<name>.png`,
    each atomically; return their paths in that order."""
    import matplotlib.pyplot as plt

    paths = [out_dir / f"{name}.json"]
    atomic_write_bytes(paths[0], (json.dumps(payload, indent=2) + "\n").encode())
    for suffix, data in (also or {}).items():
        paths.append(out_dir / f"{name}.{suffix}")
        atomic_write_bytes(paths[-1], data)
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    paths.append(out_dir / f"{name}.png")
    atomic_write_bytes(paths[-1], buffer.getvalue())
    return tuple(paths)
