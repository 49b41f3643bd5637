"""`load_dataset`: one call from a dataset name (or none) to an in-memory `ImageDataset`.

This is the policy layer over the loaders: which names exist, that an unnamed dataset means
Fashion-MNIST *by default* (and so may quietly become scikit-learn's digits, with a log line, on
a machine that is offline and has no cached copy), while a dataset the user named explicitly
never changes under them: failing to get it is a `UsageError` that says how to supply it.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

from phalanx.data.digits import load_digits_dataset
from phalanx.data.fashion_mnist import MIRRORS, FashionMnistUnavailable, Fetch, load_fashion_mnist
from phalanx.data.image_dataset import ImageDataset
from phalanx.data.synthetic import DEFAULT_SIZES, load_synthetic_dataset
from phalanx.errors import UsageError

DATASET_NAMES = ("fashion-mnist", "digits", "synthetic")
DEFAULT_DATASET = "fashion-mnist"


def load_dataset(
    name: str | None,
    data_dir: str | os.PathLike | None,
    *,
    cache_dir: str | os.PathLike | None = None,
    download: bool = True,
    log: Callable[[str], None] = print,
    synthetic_sizes: tuple[int, int] = DEFAULT_SIZES,
    fetch: Fetch | None = None,
    mirrors: Sequence[str] = MIRRORS,
) -> ImageDataset:
    """Load `name` ("fashion-mnist", "digits", "synthetic"; None = the default, fashion-mnist).

    `data_dir` is read only for Fashion-MNIST. `fetch` (url -> bytes) and `mirrors` replace the
    network, for tests and air-gapped mirrors.
    """
    explicit = name is not None
    key = (name or DEFAULT_DATASET).strip().lower().replace("_", "-")
    if key not in DATASET_NAMES:
        raise UsageError(f"unknown dataset {name!r}; choose one of {', '.join(DATASET_NAMES)}")
    if key == "digits":
        return load_digits_dataset()
    if key == "synthetic":
        n_train, n_test = synthetic_sizes
        if n_train < 1 or n_test < 1:
            raise UsageError(f"synthetic dataset sizes must be at least 1, got {n_train} train / {n_test} test; "
                             "pass positive sizes")
        return load_synthetic_dataset((n_train, n_test))
    try:
        return load_fashion_mnist(
            data_dir, cache_dir=cache_dir, download=download, fetch=fetch, mirrors=mirrors, log=log
        )
    except FashionMnistUnavailable as exc:
        if explicit:
            raise UsageError(f"cannot download Fashion-MNIST ({exc.reason}); put the four official .gz files "
                             f"in {exc.cache_dir} or pass --data-dir DIR") from None
        # Not asked for by name: a run that trains on real images beats one that stops offline.
        log(f"fashion-mnist is not cached and cannot be downloaded ({exc.reason}); training on scikit-learn's "
            "digits instead (pass --data-dir to use your own copy)")
        return load_digits_dataset()
