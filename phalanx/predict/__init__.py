"""`phalanx predict`: how fast will this train on k devices, before you have them?

It profiles one device (forward, backward, optimizer, the moment each gradient bucket is ready),
takes the link's latency α and bandwidth β (measured over loopback here, or a preset, or
flags), and predicts the step time and images/s at each k with an α–β model of the chosen
allreduce and the bucketed overlap with backward (costmodel.py, timeline.py); `--validate`
measures phalanx at the same settings right after and prints the error. This module only maps
flags onto `PredictConfig` (config.py): `add_predict_parser(subparsers)` adds the subcommand,
`run_predict(args)` runs it, printing the table and writing `predict.json` and `predict.png`
into `--out` (default runs/predict).
"""

from __future__ import annotations

import argparse
import math
import sys

from phalanx.measure.mlp import BENCH_MODELS
from phalanx.comm.algorithms import CHOICES
from phalanx.errors import UsageError
from phalanx.data_parallel import DEFAULT_BUCKET_CAP_MB
from phalanx.predict.config import INTERCONNECTS, PredictConfig, resolve_interconnect


def add_predict_parser(subparsers) -> argparse.ArgumentParser:
    """Add `predict` to an argparse subparsers object; return its parser."""
    p = subparsers.add_parser("predict", help="predict step time and images/s on k devices from one device's profile")
    p.add_argument("--model", default="lenet", help=f"one of {', '.join(BENCH_MODELS)} (default lenet)")
    p.add_argument("--batch-size", default="256", help="global batch size(s), comma-separated (default 256)")
    p.add_argument("--world-sizes", default="1,2,4,8", help="device counts k to predict (default 1,2,4,8)")
    p.add_argument("--allreduce", default="auto",
                   help=f"one of {', '.join(CHOICES)} (default auto: shm on loopback, native on the other links)")
    p.add_argument("--bucket-cap-mb", default=str(DEFAULT_BUCKET_CAP_MB),
                   help=f"gradient bucket cap in MB, or none for one bucket (default {DEFAULT_BUCKET_CAP_MB})")
    p.add_argument("--interconnect", default="loopback",
                   help=f"one of {', '.join(INTERCONNECTS)} (default loopback: measured on this machine)")
    p.add_argument("--alpha-us", default=None, help="link latency per message in microseconds (replaces the preset's)")
    p.add_argument("--beta-gbps", default=None, help="link bandwidth in GB/s, 1e9 bytes/s (replaces the preset's)")
    p.add_argument("--overlap-efficiency", default=None,
                   help="share 0..1 of overlapped communication that really hides (replaces the preset's)")
    p.add_argument("--validate", action="store_true",
                   help="measure phalanx at each k here (loopback, k <= 2 x cores) and print the error")
    p.add_argument("--rounds", type=int, default=1, help="repeat profile, link and validation (default 1)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per profile setting and measurement (default 8)")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--out", default=None, help="directory for predict.json and predict.png (default runs/predict)")
    return p


def _number(text: str | None, flag: str) -> float | None:
    """A finite float flag value, None when the flag was not given."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise UsageError(f"{flag} {text!r} is not a finite number; give e.g. {flag} 10")
    return value


def _bucket_cap(text: str) -> float | None:
    return None if text.strip().lower() == "none" else _number(text, "--bucket-cap-mb")


def build_config(args: argparse.Namespace) -> PredictConfig:
    """Flags -> PredictConfig; any bad value ends as one UsageError line."""
    from phalanx.measure.flags import parse_list

    try:
        interconnect = resolve_interconnect(
            args.interconnect, alpha_us=_number(args.alpha_us, "--alpha-us"),
            beta_gbps=_number(args.beta_gbps, "--beta-gbps"),
            overlap_efficiency=_number(args.overlap_efficiency, "--overlap-efficiency"))
        return PredictConfig(
            model=args.model, global_batch_sizes=parse_list(args.batch_size, int, flag="--batch-size"),
            world_sizes=parse_list(args.world_sizes, int, flag="--world-sizes"), algorithm=args.allreduce,
            bucket_cap_mb=_bucket_cap(args.bucket_cap_mb), interconnect=interconnect, validate=args.validate,
            rounds=args.rounds, steps=args.steps, warmup_steps=args.warmup_steps)
    except ValueError as exc:  # a config names the offending numbers: the user's to fix
        raise UsageError(str(exc)) from None


def _progress(message: str) -> None:
    print(f"phalanx predict: {message}", file=sys.stderr, flush=True)


def run_predict(args: argparse.Namespace) -> int:
    """Predict (and validate): table to stdout, predict.json + predict.png into --out. Returns 0."""
    config = build_config(args)
    # Imported here so the CLI's parser does not load torch's heavy parts or matplotlib.
    from phalanx.measure.outputs import prepare_out_dir, write_outputs
    from phalanx.predict.report import plot_prediction, report_prediction
    from phalanx.predict.run import run_prediction

    out_dir = prepare_out_dir(args.out or "runs/predict")
    payload = run_prediction(config, on_progress=_progress)
    print(report_prediction(payload), flush=True)
    json_path, png_path = write_outputs(out_dir, "predict", payload, plot_prediction(payload))
    print(f"\nwrote {json_path} and {png_path}")
    return 0


__all__ = ["add_predict_parser", "build_config", "run_predict"]
