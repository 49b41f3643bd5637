"""What every phalanx benchmark shares: warm-up then timed repeats, interleaved rounds, the
median with its min-max spread, paired ratios, the --device choice with its per-device default
sizes, and the three outputs (table, JSON, PNG).

The method (STYLE.md habit 10, nanoGPT's bench.py): warm up first, then time; run the things
being compared in the same invocation, interleaved A B A B ... round by round, so drift on a
shared machine (another job, thermal state, page cache) hits every contender alike; report the
median and the min-max of the rounds, never one number. A comparison is the median of the
per-round ratios (A_i / B_i), which cancels drift that a ratio of two medians would keep.
What this module does not know: what is being timed, or how processes are started. It does set
the one thing a timed run on CPU depends on beside the work: the intra-op thread count.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

import torch

from phalanx.atomic import atomic_write_bytes
from phalanx.errors import UsageError

T = TypeVar("T")
_SIZE_UNITS = {"B": 1, "KB": 1024, "MB": 1024**2, "GB": 1024**3}  # binary, as nccl-tests' -b/-e


@dataclass(frozen=True, kw_only=True)
class Spread:
    """Median and min-max of the samples of one measurement (one sample per round)."""

    median: float
    min: float
    max: float
    samples: tuple[float, ...]

    @classmethod
    def of(cls, samples: Sequence[float]) -> "Spread":
        if not samples:
            raise ValueError("a spread needs at least one sample, got none")
        values = tuple(float(s) for s in samples)
        return cls(median=statistics.median(values), min=min(values), max=max(values), samples=values)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Spread":
        return cls.of(data["samples"])

    def scaled(self, factor: float) -> "Spread":
        return Spread.of([s * factor for s in self.samples])

    def to_dict(self) -> dict[str, Any]:
        return {"median": self.median, "min": self.min, "max": self.max, "samples": list(self.samples)}

    def fmt(self, digits: int = 2) -> str:
        return f"{self.median:.{digits}f} ({self.min:.{digits}f}-{self.max:.{digits}f})"


def interleave(names: Sequence[T], rounds: int) -> list[tuple[int, T]]:
    """(round, name) in the order to run them: every name once per round, A B A B ..."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    return [(r, name) for r in range(rounds) for name in names]


def run_interleaved(runs: Mapping[str, Callable[[], float]], *, rounds: int,
                    warmup_rounds: int = 1) -> dict[str, list[float]]:
    """Call every run once per round, interleaved; the warm-up rounds are run and discarded."""
    for _, name in interleave(list(runs), warmup_rounds) if warmup_rounds else []:
        runs[name]()
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _, name in interleave(list(runs), rounds):
        samples[name].append(runs[name]())
    return samples


def timed(work: Callable[[], object], *, sync: Callable[[], object] | None = None) -> Callable[[], float]:
    """`work` as a timed run for run_interleaved: seconds from one `sync` to the next. The sync
    (a barrier, cuda.synchronize) makes the clock start when everyone is ready and stop when the
    last one is done, not when an asynchronous launch returns."""
    def run() -> float:
        if sync is not None:
            sync()
        start_s = time.perf_counter()
        work()
        if sync is not None:
            sync()
        return time.perf_counter() - start_s
    return run


def device_and_sizes(config: Any, defaults: Mapping[str, Mapping[str, Any]]) -> tuple[str, dict[str, Any]]:
    """A bench config's device made definite - `auto` is cuda when torch sees a GPU, else cpu, and
    cuda without one is refused - and the sizes it left None taken from that device's `defaults`."""
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda asked for, but torch sees no GPU; use --device cpu")
    sizes = {name: value if getattr(config, name) is None else getattr(config, name)
             for name, value in defaults[device].items()}
    return device, sizes


def synchronize_cuda() -> None:
    """Wait for every GPU's queued work (cuda.synchronize waits for the current device only)."""
    for index in range(torch.cuda.device_count()):
        torch.cuda.synchronize(index)


@contextlib.contextmanager
def intra_op_threads(threads: int) -> Iterator[None]:
    """PyTorch's intra-op thread count for the block, restored after. The setting is process-wide
    in practice (OpenMP and MKL take it from the last call), so contenders that need different
    counts each set theirs as they start."""
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _machine_and_own_cpu_s() -> tuple[float, float] | None:
    """(CPU seconds every process of the machine has used, this process and its reaped children's)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None  # not Linux
    # user nice system idle iowait irq softirq steal ...: everything but idle and iowait is busy
    values = [int(v) for v in fields]
    busy = sum(values) - values[3] - (values[4] if len(values) > 4 else 0)
    own = os.times()
    return busy / ticks, own.user + own.system + own.children_user + own.children_system


@contextlib.contextmanager
def cpu_taken_by_others(result: dict[str, float | None]) -> Iterator[None]:
    """Fill result["others_cores"]: how many cores other processes kept busy, on average, while the
    block ran. On a shared machine that is what a contender could not have (None off Linux)."""
    before, start_s = _machine_and_own_cpu_s(), time.perf_counter()
    try:
        yield
    finally:
        after, wall_s = _machine_and_own_cpu_s(), time.perf_counter() - start_s
        result["others_cores"] = None
        if before is not None and after is not None and wall_s > 0:
            result["others_cores"] = max(0.0, ((after[0] - before[0]) - (after[1] - before[1])) / wall_s)


def seconds_per_call(fn: Callable[[], object], iters: int, *, sync: Callable[[], None] | None = None) -> float:
    """Mean wall time of `iters` back-to-back calls; `sync` (e.g. cuda.synchronize) ends the clock."""
    if iters < 1:
        raise ValueError(f"iters must be at least 1, got {iters}")
    start_s = time.perf_counter()
    for _ in range(iters):
        fn()
    if sync is not None:
        sync()
    return (time.perf_counter() - start_s) / iters


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> Spread:
    """Spread of the per-round ratios a_i / b_i (the rounds of a and b ran side by side)."""
    if len(numerator) != len(denominator):
        raise ValueError(f"paired samples differ in length: {len(numerator)} vs {len(denominator)}")
    return Spread.of([a / b for a, b in zip(numerator, denominator)])


def parse_size(text: str) -> int:
    """'64KB' -> 65536 bytes (binary units B, KB, MB, GB; a bare number is bytes)."""
    clean = text.strip().upper().replace("IB", "B")
    for unit in sorted(_SIZE_UNITS, key=len, reverse=True):
        if clean.endswith(unit) and clean[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(clean[: -len(unit)]) * _SIZE_UNITS[unit])
    if clean.isdigit():
        return int(clean)
    raise UsageError(f"size {text!r} is not understood; write e.g. 4KB, 1MB or 65536")


def parse_list(text: str, item: Callable[[str], T], *, flag: str) -> tuple[T, ...]:
    """A comma-separated flag value as a tuple; one line naming the flag when an item is bad."""
    try:
        values = tuple(item(part.strip()) for part in text.split(",") if part.strip())
    except ValueError:
        raise UsageError(f"{flag} {text!r} is not a comma-separated list of {item.__name__}") from None
    if not values:
        raise UsageError(f"{flag} is empty; give at least one value")
    return values


def format_size(size_bytes: int) -> str:
    for unit in ("GB", "MB", "KB"):
        if size_bytes >= _SIZE_UNITS[unit] and size_bytes % _SIZE_UNITS[unit] == 0:
            return f"{size_bytes // _SIZE_UNITS[unit]}{unit}"
    return f"{size_bytes}B"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Plain aligned columns: first left-aligned, the rest right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for index, row in enumerate(cells):
        parts = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(parts).rstrip())
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def prepare_out_dir(out_dir: str | os.PathLike) -> Path:
    """Create --out (and parents) before any measuring, so a bad path costs nothing."""
    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        raise UsageError(f"--out {out_dir} is an existing file; name a directory instead")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {out_dir} cannot be created ({exc.strerror}); pick another directory") from None
    return path


def new_figure(ncols: int = 1, *, width_per_plot: float = 5.0, height: float = 3.8):
    """A matplotlib (fig, [axes]) on the Agg backend (no display on servers)."""
    import matplotlib

    matplotlib.use("Agg")  # must precede pyplot
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width_per_plot * ncols, height), dpi=100, squeeze=False)
    return fig, list(axes[0])


def rows_by_batch(rows: Sequence[Mapping[str, Any]], batches: Sequence[int]) -> list[tuple[int, list]]:
    """(global batch size, the rows of that batch in their order) for each of `batches`: the
    scaling and predict reports give each global batch its own table and its own chart panel."""
    return [(batch, [r for r in rows if r["global_batch_size"] == batch]) for batch in batches]


def panels_by_batch(rows: Sequence[Mapping[str, Any]], batches: Sequence[int], *, width_per_plot: float):
    """A figure with one panel per global batch size: (fig, [(axes, batch, the rows of that batch)])."""
    fig, axes = new_figure(len(batches), width_per_plot=width_per_plot)
    return fig, [(ax, batch, batch_rows) for ax, (batch, batch_rows) in zip(axes, rows_by_batch(rows, batches))]


def write_outputs(out_dir: Path, name: str, payload: Mapping[str, Any], fig) -> tuple[Path, Path]:
    """Write `<name>.json` and `<name>.png` atomically (a reader never sees half a file)."""
    import matplotlib.pyplot as plt

    json_path, png_path = out_dir / f"{name}.json", out_dir / f"{name}.png"
    atomic_write_bytes(json_path, (json.dumps(payload, indent=2) + "\n").encode())
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    atomic_write_bytes(png_path, buffer.getvalue())
    return json_path, png_path
