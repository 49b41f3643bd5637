"""Shared fixtures: the IDX data the tests train on, written here, so a fresh clone needs nothing beside it.

`idx_dir` is a Fashion-MNIST-shaped set generated once per session: the four gzipped IDX files
(3,000 train / 1,000 test 28x28 uint8 images, 10 classes) made from scikit-learn's bundled
digits (real handwriting, upsampled to 28x28 as phalanx's digits dataset does), each copy
shifted by up to 2 pixels and lightly noised, so the sizes - and the uneven last batches they
cause - are those of the real 3,000/1,000 sample and a model can learn it. `real_sample_dir` is
the real Fashion-MNIST sample, for the few tests about accuracy on real images; they skip,
saying how to enable them, when it is absent (CI, which always has it, fails instead).
"""

import os
from pathlib import Path

import numpy as np
import pytest
import torch

# The helper modules shared by several test files assert too: pytest explains their failures as a test's.
pytest.register_assert_rewrite("tests.distributed.runs", "tests.unit.even_split")

REPO = Path(__file__).resolve().parents[1]
SAMPLE_DIR = Path(os.environ.get("PHALANX_SAMPLE_DIR", REPO.parent / "shared" / "data" / "fashion-mnist-sample"))
NUM_TRAIN, NUM_TEST = 3000, 1000


def write_digits_idx(directory: Path, *, num_train: int = NUM_TRAIN, num_test: int = NUM_TEST, seed: int = 0) -> Path:
    """Write train-/t10k- images and labels (.gz IDX) of shifted, noised 28x28 digits into `directory`."""
    from phalanx.data import load_digits_dataset, write_idx

    digits = load_digits_dataset()
    images = torch.cat([digits.train_images, digits.test_images])
    labels = torch.cat([digits.train_labels, digits.test_labels])
    g = torch.Generator().manual_seed(seed)
    n = num_train + num_test
    pick = torch.arange(n) % images.shape[0]
    shifts = torch.randint(-2, 3, (n, 2), generator=g)
    out = torch.stack([torch.roll(images[i], shifts=(int(dy), int(dx)), dims=(1, 2))
                       for i, (dy, dx) in zip(pick.tolist(), shifts.tolist())])
    noise = torch.randint(0, 24, out.shape, generator=g, dtype=torch.int16)
    out = (out.to(torch.int16) + noise).clamp_(0, 255).to(torch.uint8)
    directory.mkdir(parents=True, exist_ok=True)
    for prefix, lo, hi in (("train", 0, num_train), ("t10k", num_train, n)):
        write_idx(directory / f"{prefix}-images-idx3-ubyte.gz", out[lo:hi, 0].numpy(), gzip=True)
        write_idx(directory / f"{prefix}-labels-idx1-ubyte.gz", labels[pick[lo:hi]].numpy().astype(np.uint8),
                  gzip=True)
    return directory


@pytest.fixture(scope="session")
def idx_dir(tmp_path_factory) -> Path:
    """A Fashion-MNIST-shaped directory of four IDX files, generated (see the module docstring)."""
    return write_digits_idx(tmp_path_factory.mktemp("idx") / "fashion-mnist-like")


@pytest.fixture(scope="session")
def real_sample_dir() -> Path:
    """The real 3,000/1,000-image Fashion-MNIST sample, for accuracy tests on real images only."""
    if not (SAMPLE_DIR / "train-images-idx3-ubyte.gz").exists():
        if os.environ.get("CI"):
            pytest.fail(f"Fashion-MNIST sample missing at {SAMPLE_DIR}")
        pytest.skip(f"real Fashion-MNIST sample not found at {SAMPLE_DIR}; to run this accuracy test set "
                    "PHALANX_SAMPLE_DIR to a directory holding the four Fashion-MNIST IDX files")
    return SAMPLE_DIR
