"""`phalanx predict`: how fast will this train on k devices, before you have them?

It profiles one device (forward, backward, optimizer, the moment each gradient bucket is ready),
takes the link's latency α and bandwidth β (measured over loopback here, or a preset, or
flags), and predicts the step time and images/s at each k with an α–β model of the chosen
allreduce and the bucketed overlap with backward (costmodel.py, timeline.py); `--validate`
measures phalanx at the same settings right after and prints the error. This module only maps
flags onto `PredictConfig` (config.py): `add_predict_parser(subparsers)` adds the subcommand,
`run_predict(args)` runs it, printing the table and writing `predict.json` and `predict.png`
into `--out` (default runs/predict). `--hosts H --link-gbit R` predicts H hosts instead, flat gloo
against the hierarchical allreduce (hosts.py).
"""

from __future__ import annotations

import argparse
import math
import sys

from phalanx.measure.mlp import BENCH_MODELS
from phalanx.comm.algorithms import CHOICES
from phalanx.errors import UsageError
from phalanx.data_parallel import DEFAULT_BUCKET_CAP_MB
from phalanx.predict.config import INTERCONNECTS, PredictConfig, host_link, resolve_interconnect


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
    p.add_argument("--hosts", default=None, help="host counts H: predict H hosts of --workers-per-host workers, "
                   "flat gloo against hierarchical, over links of --link-gbit (comma-separated)")
    p.add_argument("--workers-per-host", type=int, default=2, help="with --hosts: workers per host (default 2)")
    p.add_argument("--link-gbit", default=None, help="with --hosts: each host's link in Gbit/s")
    p.add_argument("--validate", action="store_true",
                   help="measure phalanx at each k here (loopback, k <= 2 x cores; with --hosts: on simulated "
                   "hosts) and print the error")
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
        if args.workers_per_host < 1:
            raise ValueError(f"--workers-per-host {args.workers_per_host} must be at least 1")
        if args.hosts is None and args.link_gbit is not None:
            raise ValueError(f"--link-gbit {args.link_gbit} is the link between hosts: give --hosts too")
        if args.hosts is not None:
            hosts = parse_list(args.hosts, int, flag="--hosts")
            link_gbit = _number(args.link_gbit, "--link-gbit")
            if link_gbit is None:
                raise ValueError("--hosts needs --link-gbit, the speed of each host's link (e.g. --link-gbit 10)")
            return PredictConfig(
                model=args.model, global_batch_sizes=parse_list(args.batch_size, int, flag="--batch-size"),
                bucket_cap_mb=_bucket_cap(args.bucket_cap_mb), validate=args.validate, rounds=args.rounds,
                steps=args.steps, warmup_steps=args.warmup_steps, hosts=hosts,
                workers_per_host=args.workers_per_host, link_gbit=link_gbit,
                interconnect=host_link(link_gbit, alpha_us=_number(args.alpha_us, "--alpha-us"),
                                       overlap_efficiency=_number(args.overlap_efficiency, "--overlap-efficiency"),
                                       simulated=args.validate))
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
    if config.hosts:
        from phalanx.predict.hosts import plot_hosts_prediction, report_hosts_prediction, run_hosts_prediction

        run_prediction, report_prediction, plot_prediction = (run_hosts_prediction, report_hosts_prediction,
                                                              plot_hosts_prediction)
    payload = run_prediction(config, on_progress=_progress)
    print(report_prediction(payload), flush=True)
    json_path, png_path = write_outputs(out_dir, "predict", payload, plot_prediction(payload))
    print(f"\nwrote {json_path} and {png_path}")
    return 0


__all__ = ["add_predict_parser", "build_config", "run_predict"]
