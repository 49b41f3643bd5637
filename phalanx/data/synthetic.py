"""A seeded, learnable stand-in dataset that needs no files, for tests and benchmarks.

Each class has a fixed smooth 28x28 pattern (random 7x7 noise upsampled, half a pattern shared
by all classes, half its own); an image is its class pattern plus strong per-pixel noise. The
classes are separable (nearest centroid is exact), yet the book's sigmoid LeNet at lr 0.2 needs a
few epochs to find them (train accuracy about 0.3 after 3 epochs, 0.6 after 5), so progress is
visible. Everything derives from fixed seeds, and the training and test sets use separate
generators, so the test set does not change when the training size does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phalanx.data.image_dataset import ImageDataset

DEFAULT_SIZES = (6000, 1000)
NUM_CLASSES = 10
_TEMPLATE_SEED, _TRAIN_SEED, _TEST_SEED = 0, 1, 2
_NOISE_STD = 50.0  # pixel units, against a 0..160 pattern range
_OWN_WEIGHT = 0.5  # share of a class pattern that is its own; lower makes the classes harder to tell apart


def _class_patterns() -> torch.Tensor:
    """[10,1,28,28] float patterns in [0, 1]: smooth, so neighbouring pixels agree like real strokes."""
    coarse = torch.rand(NUM_CLASSES + 1, 1, 7, 7, generator=torch.Generator().manual_seed(_TEMPLATE_SEED))
    smooth = F.interpolate(coarse, size=(28, 28), mode="bilinear", align_corners=False)
    shared, own = smooth[NUM_CLASSES:], smooth[:NUM_CLASSES]
    return (1 - _OWN_WEIGHT) * shared + _OWN_WEIGHT * own


def _sample(patterns: torch.Tensor, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, NUM_CLASSES, (n,), generator=generator)
    noise = torch.randn(n, 1, 28, 28, generator=generator) * _NOISE_STD
    pixels = 40.0 + 160.0 * patterns[labels] + noise
    return pixels.round_().clamp_(0, 255).to(torch.uint8), labels


def load_synthetic_dataset(sizes: tuple[int, int] = DEFAULT_SIZES) -> ImageDataset:
    """`sizes` = (n_train, n_test) images, uint8 [N,1,28,28], labels 0..9; same sizes, same bytes."""
    n_train, n_test = sizes
    patterns = _class_patterns()
    train_images, train_labels = _sample(patterns, n_train, _TRAIN_SEED)
    test_images, test_labels = _sample(patterns, n_test, _TEST_SEED)
    return ImageDataset(
        name="synthetic",
        train_images=train_images,
        train_labels=train_labels,
        test_images=test_images,
        test_labels=test_labels,
        source=f"synthetic class patterns plus noise (seeded, {n_train}+{n_test})",
    )
