"""A small Fashion-MNIST-shaped dataset written as IDX files, for the split tests (no ../shared needed).

600 training images (batch 128: four full batches and an uneven last one of 88) and 200 test
images, drawn from phalanx's seeded synthetic class patterns, written as the four gzipped IDX
files `--data-dir` reads.
"""

from pathlib import Path

from phalanx.data import load_synthetic_dataset
from phalanx.data.idx import write_idx

TRAIN, TEST = 600, 200


def write_small_fashion_mnist(directory: Path) -> Path:
    data = load_synthetic_dataset((TRAIN, TEST))
    directory.mkdir(parents=True, exist_ok=True)
    for stem, tensor in (("train-images-idx3-ubyte", data.train_images.squeeze(1)),
                         ("train-labels-idx1-ubyte", data.train_labels),
                         ("t10k-images-idx3-ubyte", data.test_images.squeeze(1)),
                         ("t10k-labels-idx1-ubyte", data.test_labels)):
        write_idx(directory / f"{stem}.gz", tensor.numpy().astype("uint8"), gzip=True)
    return directory
