"""IDX reader/writer: round trips, and every malformed file is an IdxError, never a crash or a huge allocation.

Hand-picked cases with exact messages; tests/unit/test_idx_fuzz.py generates the rest.
"""

from __future__ import annotations

import gzip
import os
import struct
import tracemalloc

import numpy as np
import pytest

from phalanx.data import IdxError, read_idx, write_idx
from phalanx.data import idx as idx_module
from phalanx.errors import UsageError

DTYPES = ["uint8", "int8", "int16", "int32", "float32", "float64"]
SHAPES = [(7,), (3, 5), (4, 6, 6), (2, 3, 4, 5), (0, 28, 28)]


@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip(tmp_path, compressed, dtype, shape):
    rng = np.random.default_rng(0)
    array = (rng.standard_normal(shape) * 100).astype(dtype)
    path = tmp_path / "a.idx"
    write_idx(path, array, gzip=compressed)
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == compressed
    back = read_idx(path)
    assert back.dtype == array.dtype and back.dtype.isnative and back.flags.writeable
    np.testing.assert_array_equal(back, array)


def test_gzip_detected_by_magic_not_name(tmp_path):
    array = np.arange(12, dtype=np.uint8).reshape(3, 4)
    write_idx(tmp_path / "looks-raw", array, gzip=True)
    write_idx(tmp_path / "looks.gz", array, gzip=False)
    np.testing.assert_array_equal(read_idx(tmp_path / "looks-raw"), array)
    np.testing.assert_array_equal(read_idx(tmp_path / "looks.gz"), array)


def test_write_is_atomic_and_leaves_no_temp(tmp_path):
    write_idx(tmp_path / "a", np.zeros(3, np.uint8), gzip=False)
    write_idx(tmp_path / "a", np.ones(5, np.uint8), gzip=True)  # overwrite in place
    assert [p.name for p in tmp_path.iterdir()] == ["a"]
    assert read_idx(tmp_path / "a").tolist() == [1] * 5


def test_write_rejects_unsupported(tmp_path):
    with pytest.raises(ValueError, match="int64"):
        write_idx(tmp_path / "a", np.zeros(3, np.int64), gzip=False)
    with pytest.raises(ValueError, match="5 dimensions"):
        write_idx(tmp_path / "a", np.zeros((1,) * 5, np.uint8), gzip=False)


def _raw(shape, dtype_code=0x08, payload=b""):
    return bytes([0, 0, dtype_code, len(shape)]) + struct.pack(f">{len(shape)}I", *shape) + payload


@pytest.mark.parametrize("compressed", [False, True])
def test_truncated(tmp_path, compressed):
    # Random bytes do not compress, so even the gzip copy passes the inflate-ratio bound and is read.
    payload = np.random.default_rng(0).integers(0, 256, 1000, dtype=np.uint8).tobytes()
    data = _raw((3, 28, 28), payload=payload)
    path = tmp_path / "t"
    path.write_bytes(gzip.compress(data) if compressed else data)
    where = "decompressed data" if compressed else "file"
    expected = rf"truncated: header says 3x28x28 uint8 = 2352 bytes, {where} has 1000 bytes after the header; re-download"
    with pytest.raises(IdxError, match=expected):
        read_idx(path)


def test_truncated_gzip_judged_by_its_size_before_inflating(tmp_path):
    path = tmp_path / "t.gz"
    path.write_bytes(gzip.compress(_raw((3000, 28, 28), payload=bytes(1000))))
    size = path.stat().st_size
    with pytest.raises(IdxError, match=rf"truncated: .* more than a {size}-byte gzip file can inflate to \(1032x"):
        read_idx(path)


@pytest.mark.parametrize("compressed", [False, True])
def test_trailing_bytes(tmp_path, compressed):
    data = _raw((2, 2), payload=bytes(5))
    path = tmp_path / "t"
    path.write_bytes(gzip.compress(data) if compressed else data)
    with pytest.raises(IdxError, match="trailing bytes"):
        read_idx(path)


@pytest.mark.parametrize(
    "content, pattern",
    [
        (b"", "empty"),
        (b"PK\x03\x04rest", "not an IDX file"),
        (b"\x00\x01\x08\x01\x00\x00\x00\x01\x05", "not an IDX file"),
        (b"\x00\x00\x07\x01\x00\x00\x00\x01\x05", "dtype code 0x07"),
        (b"\x00\x00\x08\x00", "0 dimensions"),
        (b"\x00\x00\x08\x05" + bytes(20), "5 dimensions"),
        (b"\x00\x00\x08\x03\x00\x00\x00\x01", "inside the header"),
        (b"\x00\x00", "not an IDX file"),
        (b"\x1f\x8b\x08\x00garbage", "truncated: the gzip stream ends before its end marker"),
        (b"\x1f\x8b", "truncated: the gzip stream ends"),
        (b"\x1f\x8b\x08\x00" + bytes(6) + b"\xff" * 8, r"corrupt gzip data \(.*invalid block type"),
        (b"\x1f\x8b\x07\x00" + bytes(6), r"corrupt gzip data \(Unknown compression method\)"),
        # Empty, but numpy cannot even describe a 0 x 2**32-1 x 2**32-1 x 2**32-1 shape.
        (b"\x00\x00\x0e\x04" + bytes(4) + b"\xff" * 12, "over the .* byte limit \\(its nonzero dimensions alone\\)"),
    ],
)
def test_malformed(tmp_path, content, pattern):
    path = tmp_path / "bad"
    path.write_bytes(content)
    with pytest.raises(IdxError, match=pattern) as info:
        read_idx(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    assert isinstance(info.value, UsageError)


def test_corrupt_gzip_crc(tmp_path):
    good = gzip.compress(_raw((4,), payload=b"\x01\x02\x03\x04"))
    bad = good[:-8] + bytes(4) + good[-4:]  # wrong CRC32 in the trailer
    (tmp_path / "g").write_bytes(bad)
    with pytest.raises(IdxError, match="corrupt gzip"):
        read_idx(tmp_path / "g")


def test_missing_file(tmp_path):
    with pytest.raises(IdxError, match="no such file"):
        read_idx(tmp_path / "nope")


def test_empty_array_is_fine(tmp_path):
    path = tmp_path / "e"
    path.write_bytes(_raw((0, 28, 28)))
    assert read_idx(path).shape == (0, 28, 28)


def test_not_a_regular_file(tmp_path):
    os.mkfifo(tmp_path / "fifo")  # opening it for reading would block forever
    for path in (tmp_path, tmp_path / "fifo"):
        with pytest.raises(IdxError, match="not a regular file; point to the IDX file itself"):
            read_idx(path)


def test_permission_denied(tmp_path, monkeypatch):
    # Simulated, so it runs as root too (root reads a chmod 000 file anyway); the real chmod
    # case is in tests/unit/test_bad_input.py.
    path = tmp_path / "locked"
    path.write_bytes(_raw((1,), payload=b"\x01"))

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(idx_module, "open", denied, raising=False)
    with pytest.raises(IdxError, match=r"locked: permission denied; make it readable \(chmod a\+r\)"):
        read_idx(path)


def test_read_error_is_an_idx_error(tmp_path, monkeypatch):
    path = tmp_path / "a"
    write_idx(path, np.zeros(4, np.uint8), gzip=False)

    def failing(stream, limit):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(idx_module, "_read_at_most", failing)
    with pytest.raises(IdxError, match="cannot read .*Input/output error.*check the disk"):
        read_idx(path)


@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize(
    "shape, dtype_code, pattern",
    [
        ((0xFFFFFFFF,) * 4, 0x0E, "over the .* byte limit"),  # ~2**131 bytes claimed
        ((30000, 256, 256), 0x08, "truncated"),  # 1.9 GiB: under the cap, so it must not be pre-allocated
    ],
)
def test_lying_header_allocates_nothing_big(tmp_path, compressed, shape, dtype_code, pattern):
    data = _raw(shape, dtype_code, payload=bytes(100))
    path = tmp_path / "liar"
    path.write_bytes(gzip.compress(data) if compressed else data)
    tracemalloc.start()
    try:
        with pytest.raises(IdxError, match=pattern):
            read_idx(path)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_bytes < 16 * 1024**2


def test_gzip_bomb_behind_small_header_stops_early(tmp_path):
    # Header says 10 bytes; the stream inflates to 32 MiB. Only claim + 1 bytes may be inflated.
    path = tmp_path / "bomb"
    path.write_bytes(gzip.compress(_raw((10,)) + bytes(32 * 1024**2), compresslevel=1))
    tracemalloc.start()
    try:
        with pytest.raises(IdxError, match="trailing bytes"):
            read_idx(path)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_bytes < 8 * 1024**2
