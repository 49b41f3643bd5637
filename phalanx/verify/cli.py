"""`phalanx verify`: its options (generated from `VerifyCommand`), a model and a dataset; the report; the exit code.

`VerifyCommand` holds what the command itself decides (the model, the data, a planted bug, the
JSON report) beside its components, each declared once where it lives: the comparison
(`VerifyConfig`, config.py) and the model split (`SplitConfig`, the one `phalanx train` takes).
`add_verify_arguments` fills the subcommand's parser from it; `run_verify(args)` runs it: 0 when
every k agrees with 1 device, 1 when one does not (usable in CI), and bad input is a one-line
`UsageError`. `--plant` puts a known bug into the k-device runs so the diagnosis can be seen at
work: `rank-mean` (each rank's mean loss / k: wrong on uneven shards), `rank-sum` (the ranks'
means summed: k x the gradient), `shuffle-per-rank` (each rank draws its own data order).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from phalanx.data.datasets import DATASET_NAMES
from phalanx.errors import UsageError
from phalanx.model_split.config import SplitConfig
from phalanx.models import MODELS
from phalanx.options import add_options, build, check_options, component, option
from phalanx.outdir import check_out_file
from phalanx.verify.config import VerifyConfig

PLANTS = ("none", "rank-mean", "rank-sum", "shuffle-per-rank")


@dataclass(frozen=True, kw_only=True)
class VerifyCommand:
    """phalanx verify"""

    model: str = option("lenet", choices=MODELS, help="the model trained on 1 and on k devices")
    dataset: str = option("synthetic", choices=DATASET_NAMES, help="the data its batches come from")
    data_dir: str | None = option(None, metavar="DIR", default_text="the download cache",
                                  help="directory with Fashion-MNIST's four IDX files")
    plant: str = option("none", choices=PLANTS, help="plant a known bug into the k-device runs")
    out: str | None = option(None, metavar="FILE", default_text="not written",
                             help="also write the report as JSON to FILE")
    split: SplitConfig = component(SplitConfig)
    comparison: VerifyConfig = component(VerifyConfig)

    def __post_init__(self) -> None:
        check_options(self)
        if self.plant != "none" and self.split.kind != "data":
            raise ValueError(f"--plant plants data-parallel bugs; drop it with --split {self.split.kind}")

    def verify_config(self) -> VerifyConfig:
        """The comparison with the planted bug, if any, in the k-device runs."""
        return replace(self.comparison, shuffle_per_rank=self.plant == "shuffle-per-rank",
                       loss_scale=self.plant if self.plant in ("rank-mean", "rank-sum") else "global")


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(parser, VerifyCommand)


def run_verify(args: argparse.Namespace) -> int:
    """Run the comparison `args` describes; print the report; 0 pass, 1 fail."""
    # Imported here so the CLI's parser does not pay for them.
    from phalanx.atomic import atomic_write_bytes
    from phalanx.data import load_dataset
    from phalanx.models import build_model
    from phalanx.verify.api import verify

    command = build(VerifyCommand, args)
    check_out_file(command.out)
    config = command.verify_config()
    examples = max(config.steps * config.global_batch_size, config.global_batch_size)
    dataset = load_dataset(command.dataset, command.data_dir, synthetic_sizes=(examples, 1), log=_progress)
    model_fn = functools.partial(build_model, command.model, num_classes=dataset.num_classes)
    title = f"{command.model} on {dataset.name}" + (f" with planted {command.plant}" if command.plant != "none" else "")
    split = command.split
    try:
        if split.kind != "data":  # the model-parallel splits: their own k-device run
            from phalanx.verify.split import verify_split

            report = verify_split(model_fn, (dataset.train_images, dataset.train_labels), split=split.kind,
                                  config=config, micro_batches=split.micro_batches, schedule=split.schedule,
                                  title=f"{title}, split {split.kind}", log=_progress)
        else:
            report = verify(model_fn, (dataset.train_images, dataset.train_labels), config=config, title=title,
                            log=_progress)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print(report.render(), flush=True)
    if command.out is not None:
        out = Path(command.out)
        atomic_write_bytes(out, (json.dumps(report.to_dict(), indent=2) + "\n").encode())
        print(f"wrote {out}")
    return 0 if report.passed else 1


def _progress(message: str) -> None:
    print(f"phalanx verify: {message}", file=sys.stderr, flush=True)
