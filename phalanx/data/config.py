"""The data options of a training run: which data set (--dataset), where its files are (--data-dir)
and how many of its training images to use (--train-examples).

Declared once here (phalanx/options.py makes the flags); `DataConfig.load` reads the data as they
say (datasets.py's `load_dataset`, then the first --train-examples images), wherever a run loads it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from phalanx.data.datasets import DATASET_NAMES, DEFAULT_DATASET, load_dataset
from phalanx.data.image_dataset import ImageDataset
from phalanx.errors import UsageError
from phalanx.options import at_least, check_options, option


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """data"""

    # None: the default data set, not named by the user (so it may fall back, with a line, offline).
    dataset: str | None = option(None, help="the data set", choices=DATASET_NAMES,
                                 default_text=f"{DEFAULT_DATASET}, or digits when it cannot be had")
    directory: str | None = option(None, flag="--data-dir", help="directory with Fashion-MNIST's four IDX files",
                                   default_text="the download cache")
    # A quick run on part of the data, as Hugging Face's examples' --max_train_samples (the test set stays whole).
    train_examples: int | None = option(None, help="train on the first N training images", metavar="N",
                                        default_text="all of them", check=at_least(1))

    def __post_init__(self) -> None:
        check_options(self)
        if self.directory is not None and self.dataset not in (None, DEFAULT_DATASET):
            raise ValueError(f"--data-dir holds {DEFAULT_DATASET}'s files, which --dataset {self.dataset} does not "
                             f"read; drop --data-dir, or drop --dataset to train on {DEFAULT_DATASET}")

    def load(self, *, log: Callable[[str], None] = print) -> ImageDataset:
        """The data set these options name (downloaded and cached, or the offline fallback: datasets.py),
        cut to its first `train_examples` training images; more than it has is refused in one line."""
        data = load_dataset(self.dataset, self.directory, log=log)
        if self.train_examples is None:
            return data
        if self.train_examples > data.num_train:
            raise UsageError(f"--train-examples {self.train_examples} is more than the {data.num_train} training "
                             f"images {data.name} has; use at most {data.num_train}, or leave it out for all of them")
        return data.first_train_examples(self.train_examples)

    def resolved(self, data: ImageDataset) -> DataConfig:
        """These options naming the data `load` returned (an unnamed fashion-mnist's offline fallback
        included, and the cache it was read from), so every process that loads them reads the same."""
        return replace(self, dataset=data.name, directory=data.data_dir)
