"""`identity_checksum`: what a stream check compares across ranks. The order of items and their
keys, labels and token ids change it; their floating values, images and unknown objects do not
(a per-rank random augmentation must not read as other items); the bytes it hashes are fixed
(CRC-32, not Python's per-process `hash`), so a known input has a known checksum."""

from __future__ import annotations

import dataclasses
import zlib

import numpy
import torch

from phalanx.data.item_identity import identity_checksum


def _items(order, *, noise: float = 0.0) -> list:
    return [(torch.full((2, 2), float(i) + noise), i) for i in order]


def test_order_and_labels_change_it_floating_values_do_not():
    base = identity_checksum(_items([0, 1, 2, 3]))
    assert base[0] == 4 and base == identity_checksum(_items([0, 1, 2, 3], noise=0.37))
    assert identity_checksum(_items([1, 0, 2, 3]))[1] != base[1]
    assert identity_checksum(_items([0, 1, 2, 4]))[1] != base[1]


def test_keys_captions_token_ids_and_numpy_labels_count_images_and_objects_do_not():
    @dataclasses.dataclass
    class Example:
        tokens: torch.Tensor
        score: float

    items = [{"__key__": "a/001", "jpg": b"\xff\xd8raw", "caption": "a cat", "label": numpy.int64(3),
              "mask": numpy.array([1, 0], dtype=numpy.uint8), "image": torch.zeros(3, 4, 4, dtype=torch.uint8),
              "example": Example(torch.tensor([5, 6, 7]), 0.5), "thing": object(), "ratio": 0.25}]
    count, checksum = identity_checksum(items)
    # keys (9 names) + __key__, jpg, caption, label, mask + tokens: the uint8 image, floats and the object are left out
    assert count == 9 + 6
    changed = [dict(items[0], caption="a dog")]
    assert identity_checksum(changed)[1] != checksum
    changed = [dict(items[0], example=Example(torch.tensor([5, 6, 8]), 0.5))]
    assert identity_checksum(changed)[1] != checksum
    same = [dict(items[0], image=torch.ones(3, 4, 4, dtype=torch.uint8), thing=object(), ratio=0.75)]
    assert identity_checksum(same) == (count, checksum)


def test_the_checksum_is_crc32_over_fixed_bytes():
    data = b"s" + "key".encode()
    want = zlib.crc32(len(data).to_bytes(4, "little") + data)
    assert identity_checksum(["key"]) == (1, want)
    assert identity_checksum([]) == (0, 0) and identity_checksum([torch.randn(3)]) == (0, 0)
