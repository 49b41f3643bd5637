"""Data for data-parallel training: datasets in memory, and how each global batch is split.

`load_dataset` returns an `ImageDataset` (Fashion-MNIST from a directory or the verified
download cache, scikit-learn's digits, or a synthetic set); `global_batches`, `rank_shard` and
the book's `split_batch` decide which examples each device sees. Nothing here communicates:
every rank computes the same answer from the same arguments.
"""

from phalanx.data.datasets import DATASET_NAMES, DEFAULT_DATASET, load_dataset
from phalanx.data.digits import load_digits_dataset
from phalanx.data.fashion_mnist import (
    MIRRORS,
    OFFICIAL_MD5,
    FashionMnistUnavailable,
    cache_dir_for,
    ensure_cached,
    fetch_url,
    load_fashion_mnist,
    read_fashion_mnist_dir,
)
from phalanx.data.idx import IdxError, read_idx, write_idx
from phalanx.data.image_dataset import ImageDataset, to_float
from phalanx.data.split import (
    EpochBatches,
    global_batches,
    rank_shard,
    shard_bounds,
    shard_sizes,
    split_batch,
    steps_per_epoch,
)
from phalanx.data.synthetic import load_synthetic_dataset

__all__ = [
    "DATASET_NAMES",
    "DEFAULT_DATASET",
    "MIRRORS",
    "OFFICIAL_MD5",
    "EpochBatches",
    "FashionMnistUnavailable",
    "IdxError",
    "ImageDataset",
    "cache_dir_for",
    "ensure_cached",
    "fetch_url",
    "global_batches",
    "load_dataset",
    "load_digits_dataset",
    "load_fashion_mnist",
    "load_synthetic_dataset",
    "rank_shard",
    "read_fashion_mnist_dir",
    "read_idx",
    "shard_bounds",
    "shard_sizes",
    "split_batch",
    "steps_per_epoch",
    "to_float",
    "write_idx",
]
