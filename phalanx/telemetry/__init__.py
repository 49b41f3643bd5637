"""Telemetry: rank-0 logging, the progress bar, per-epoch metrics (JSONL), the accuracy plot
and the Chrome traces of `--trace`.

Knows nothing of ranks beyond the `enabled` flags it is given: callers decide who reports.
"""

from phalanx.telemetry.log import RankZeroLog, survive_lost_output
from phalanx.telemetry.metrics import MetricsFile
from phalanx.telemetry.plot import plot_accuracy
from phalanx.telemetry.progress import ProgressBar
from phalanx.telemetry.tracing import Tracer, format_summary, span

__all__ = ["RankZeroLog", "survive_lost_output", "MetricsFile", "plot_accuracy", "ProgressBar", "Tracer",
           "format_summary", "span"]
