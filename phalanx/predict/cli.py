"""`phalanx predict`: its parser (generated from `PredictConfig` and its link's options) and its runner.

`add_predict_arguments` fills the subcommand's parser from the config (every flag, default and
check declared once, on its fields: phalanx/options.py); `run_predict` builds the config, runs the
prediction, prints the table and writes `predict.json` and `predict.png` into `--out`.
"""

from __future__ import annotations

import argparse
import sys

from phalanx.options import add_options, build
from phalanx.predict.config import PredictConfig


def add_predict_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(parser, PredictConfig)


def _progress(message: str) -> None:
    print(f"phalanx predict: {message}", file=sys.stderr, flush=True)


def run_predict(args: argparse.Namespace) -> int:
    """Predict (and validate): table to stdout, predict.json + predict.png into --out. Returns 0."""
    config = build(PredictConfig, args)
    # Imported here so the CLI's parser does not load torch's heavy parts or matplotlib.
    from phalanx.measure.outputs import prepare_out_dir, write_outputs
    from phalanx.predict.report import plot_prediction, report_prediction
    from phalanx.predict.run import run_prediction

    out_dir = prepare_out_dir(config.out_dir)
    if config.hosts:
        from phalanx.predict.hosts import plot_hosts_prediction, report_hosts_prediction, run_hosts_prediction

        run_prediction, report_prediction, plot_prediction = (run_hosts_prediction, report_hosts_prediction,
                                                              plot_hosts_prediction)
    payload = run_prediction(config, on_progress=_progress)
    print(report_prediction(payload), flush=True)
    json_path, png_path = write_outputs(out_dir, "predict", payload, plot_prediction(payload))
    print(f"\nwrote {json_path} and {png_path}")
    return 0
