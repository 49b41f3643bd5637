"""The data options of a training run: which data set (--dataset) and where its files are (--data-dir).

Declared once here (phalanx/options.py makes the flags); `load_dataset` (datasets.py) reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.data.datasets import DATASET_NAMES, DEFAULT_DATASET
from phalanx.options import check_options, option


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """data"""

    # None: the default data set, not named by the user (so it may fall back, with a line, offline).
    dataset: str | None = option(None, help="the data set", choices=DATASET_NAMES,
                                 default_text=f"{DEFAULT_DATASET}, or digits when it cannot be had")
    directory: str | None = option(None, flag="--data-dir", help="directory with Fashion-MNIST's four IDX files",
                                   default_text="the download cache")

    def __post_init__(self) -> None:
        check_options(self)
        if self.directory is not None and self.dataset not in (None, DEFAULT_DATASET):
            raise ValueError(f"--data-dir holds {DEFAULT_DATASET}'s files, which --dataset {self.dataset} does not "
                             f"read; drop --data-dir, or drop --dataset to train on {DEFAULT_DATASET}")
