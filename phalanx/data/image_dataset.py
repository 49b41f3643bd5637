"""The in-memory dataset every loader returns: uint8 images [N,1,28,28] and int64 labels, both splits.

Keeping images as uint8 (a quarter of float32's memory; the full Fashion-MNIST is 55 MB) and
converting per batch with `to_float` lets every rank hold the whole set and index its own shard
without a DataLoader. The conversion matches the book's `transforms.ToTensor()`: divide by 255,
no mean/std normalisation. This module owns the type and its invariants, not where data comes from.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

IMAGE_SHAPE = (1, 28, 28)


def to_float(images_uint8: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 images -> `dtype` in [0, 1] on the same device, as torchvision's ToTensor scales them.

    Computed as x * (1/255) in `dtype` itself, bitwise the same on every device: CUDA divides a
    tensor by a Python number as a multiplication by its reciprocal while the CPU divides, and
    the two disagree by one float32 ulp on 126 of the 256 pixel values. Converting through
    float32 and dividing therefore fed cuda:0 and cpu:1 different float64 inputs: after 2 epochs
    of the sample their parameters were 1.1e-7 apart (largest difference / largest parameter),
    where the same conversion everywhere leaves nothing but summation order."""
    if images_uint8.dtype != torch.uint8:
        raise ValueError(f"to_float: expected uint8 images, got {images_uint8.dtype}")
    return images_uint8.to(dtype).mul_(1 / 255)


@dataclass(frozen=True)
class ImageDataset:
    name: str  # "fashion-mnist", "digits", "synthetic"
    train_images: torch.Tensor  # uint8 [N,1,28,28]
    train_labels: torch.Tensor  # int64 [N]
    test_images: torch.Tensor  # uint8 [M,1,28,28]
    test_labels: torch.Tensor  # int64 [M]
    num_classes: int = 10
    source: str = ""  # where it came from, for the log line
    # The directory the files were read from (a user's --data-dir or the verified cache), so a
    # launcher can hand it to worker processes and they re-read the same files with no download;
    # None for the built-in sets.
    data_dir: str | None = None

    def __post_init__(self) -> None:
        # Loaders validate user files with UsageError; reaching here with bad tensors is a bug.
        for split in ("train", "test"):
            images, labels = getattr(self, f"{split}_images"), getattr(self, f"{split}_labels")
            if images.dtype != torch.uint8 or tuple(images.shape[1:]) != IMAGE_SHAPE or images.dim() != 4:
                raise ValueError(f"ImageDataset {self.name}: {split}_images must be uint8 [N,1,28,28], "
                                 f"got {images.dtype} {list(images.shape)}")
            if labels.dtype != torch.int64 or labels.dim() != 1 or labels.shape[0] != images.shape[0]:
                raise ValueError(f"ImageDataset {self.name}: {split}_labels must be int64 [{images.shape[0]}], "
                                 f"got {labels.dtype} {list(labels.shape)}")
            if labels.numel() and not (0 <= int(labels.min()) and int(labels.max()) < self.num_classes):
                raise ValueError(f"ImageDataset {self.name}: {split}_labels span {int(labels.min())}.."
                                 f"{int(labels.max())}, outside 0..{self.num_classes - 1}")

    @property
    def num_train(self) -> int:
        return self.train_images.shape[0]

    @property
    def num_test(self) -> int:
        return self.test_images.shape[0]

    def first_train_examples(self, count: int) -> ImageDataset:
        """This data set with only its first `count` training images (views, no copy); the test set whole."""
        return replace(self, train_images=self.train_images[:count], train_labels=self.train_labels[:count])

    def describe(self) -> str:
        """One line for the run log: name, sizes, source."""
        return f"{self.name}: {self.num_train} train / {self.num_test} test images from {self.source or 'memory'}"
