"""scikit-learn's bundled handwritten digits, dressed as a 28x28 Fashion-MNIST stand-in.

`sklearn.datasets.load_digits` ships 1,797 real 8x8 images (values 0..16) inside the package, so
this dataset exists on every machine with no network. It is what training falls back to when
Fashion-MNIST was not asked for by name and cannot be fetched. Images are upsampled to 28x28 so
the book's LeNet runs unchanged; the split is a fixed permutation, identical on every rank.

The images are read from the file scikit-learn ships them in (`sklearn/datasets/data/digits.csv.gz`,
found without importing the package), as `load_digits` reads it: importing scikit-learn costs
~1.1 s of a core on the 2-core CI machine in the launcher and again in every worker, and it sets
KMP_DUPLICATE_LIB_OK and KMP_INIT_AT_FORK in the environment, which a fork server started
before it does not have: the launch then stops that server and starts another, which imports
torch again (`phalanx train --devices 2 --epochs 1` on the fallback took 10.4-10.6 s against
6.6-7.0 s with those variables set beforehand). Where that file is not found (another layout),
`load_digits` itself; tests/unit/test_data_datasets.py holds the two to the same values.
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from phalanx.data.image_dataset import ImageDataset

SPLIT_SEED = 0


def load_digits_dataset() -> ImageDataset:
    """1,437 train / 360 test digits as uint8 [N,1,28,28], int64 labels 0..9."""
    images_8x8, targets = bundled_digits()
    pixels = torch.as_tensor(images_8x8, dtype=torch.float32).unsqueeze(1)  # [1797,1,8,8], 0..16
    # Bilinear with align_corners=False keeps the 8x8 grid's extent (PyTorch's default convention).
    resized = F.interpolate(pixels, size=(28, 28), mode="bilinear", align_corners=False)
    images = (resized * (255.0 / 16.0)).round_().clamp_(0, 255).to(torch.uint8)
    labels = torch.as_tensor(targets, dtype=torch.int64)
    n = images.shape[0]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED))
    num_test = -(-n // 5)  # ceil(20%): 360 of 1,797
    train, test = order[: n - num_test], order[n - num_test :]
    return ImageDataset(
        name="digits",
        train_images=images[train],
        train_labels=labels[train],
        test_images=images[test],
        test_labels=labels[test],
        source="scikit-learn load_digits (8x8 resized to 28x28)",
    )


def bundled_digits() -> tuple[np.ndarray, np.ndarray]:
    """`load_digits()`'s `images` (float64 [1797, 8, 8]) and `target` (int), read from scikit-learn's
    bundled CSV without importing scikit-learn (above); by `load_digits` where the file is not there."""
    path = _bundled_csv()
    if path is None:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return bunch.images, bunch.target
    with gzip.open(path, mode="rt", encoding="utf-8") as rows:
        data = np.loadtxt(rows, delimiter=",")  # 64 pixels, then the label, per row
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


def _bundled_csv() -> Path | None:
    """scikit-learn's digits.csv.gz, located by the import system without running the package."""
    try:
        spec = importlib.util.find_spec("sklearn")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return None
    for root in spec.submodule_search_locations or ():
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    return None
