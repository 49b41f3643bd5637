"""scikit-learn's bundled handwritten digits, dressed as a 28x28 Fashion-MNIST stand-in.

`sklearn.datasets.load_digits` ships 1,797 real 8x8 images (values 0..16) inside the package, so
this dataset exists on every machine with no network. It is what training falls back to when
Fashion-MNIST was not asked for by name and cannot be fetched. Images are upsampled to 28x28 so
the book's LeNet runs unchanged; the split is a fixed permutation, identical on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phalanx.data.image_dataset import ImageDataset

SPLIT_SEED = 0


def load_digits_dataset() -> ImageDataset:
    """1,437 train / 360 test digits as uint8 [N,1,28,28], int64 labels 0..9."""
    from sklearn.datasets import load_digits  # deferred: sklearn costs ~0.5 s to import

    bunch = load_digits()
    pixels = torch.as_tensor(bunch.images, dtype=torch.float32).unsqueeze(1)  # [1797,1,8,8], 0..16
    # Bilinear with align_corners=False keeps the 8x8 grid's extent (PyTorch's default convention).
    resized = F.interpolate(pixels, size=(28, 28), mode="bilinear", align_corners=False)
    images = (resized * (255.0 / 16.0)).round_().clamp_(0, 255).to(torch.uint8)
    labels = torch.as_tensor(bunch.target, dtype=torch.int64)
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
