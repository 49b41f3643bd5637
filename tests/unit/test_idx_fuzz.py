"""Fuzzing the IDX reader: 10,500 generated files, each read exactly right or refused cleanly.

Every input is written to one file and `read_idx` is checked against `_reference`, a decoder
written here from the format's description (http://yann.lecun.com/exdb/mnist/, "FILE FORMATS";
gzip through `gzip.decompress`, a separate code path from the reader's streaming one):

- the reader returns an array exactly when the reference decodes one, with the header's shape,
  the declared dtype (native byte order, writable) and the same values;
- otherwise it raises `IdxError` (a `UsageError`) whose one-line message names the file, the
  defect and, after "; ", the fix; any other exception fails the test;
- a lying header allocates nothing big: tracemalloc's peak during the call stays within a small
  multiple of what the file really holds, whatever size the header claims, plus what reading
  costs whatever the file holds (`READ_OVERHEAD_BYTES`, `GZIP_READER_BYTES`: the gzip module's
  buffers grew 16-fold in Python 3.12, so that part is computed from the running Python);
- each family of inputs reaches the defects it is built to reach (the refusals are tallied by
  their message), so a generator that stops producing one fails instead of passing quietly.

Inputs: random bytes (raw and behind gzip magic), valid files with mutated magic, dtype code, ndim,
dims, truncation and extra bytes (raw and gzip-wrapped), headers claiming up to ~2**128 bytes,
and damaged gzip streams (deflate bytes, flags, CRC/length trailer, cuts, padding, extra members).
They come from numpy's generator with fixed seeds, so CI sees the same 10,500 inputs every run,
and a failure shows the input's bytes. The one-case-per-defect catalogue is test_data_idx.py.
"""

from __future__ import annotations

import gzip
import io
import math
import re
import struct
import tracemalloc
import zlib
from collections import Counter

import numpy as np
import pytest

from phalanx.data.idx import MAX_PAYLOAD_BYTES, IdxError, read_idx
from phalanx.errors import UsageError

CODES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
# Message phrase -> defect name, for the tallies each test checks (first match wins).
DEFECTS = [("empty", "empty"), ("not an IDX", "magic"), ("dtype code", "dtype code"), ("dimensions (supported", "ndim"),
           ("inside the header", "header cut short"), ("byte limit", "claim over the limit"),
           ("can inflate to", "claim beyond the gzip's size"), ("truncated", "truncated"),
           ("trailing bytes", "trailing bytes"), ("corrupt gzip", "corrupt gzip")]
U32_EDGES = [0, 1, 2, 3, 28, 255, 256, 2**16, 2**24, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1]


# What a read costs whatever the file holds: the opened file's buffer (io.DEFAULT_BUFFER_SIZE),
# the header's bytes objects and an error message; at most 6.4 KB measured on CPython 3.11.
READ_OVERHEAD_BYTES = 32 * 1024
# What reading through gzip adds, also whatever the file holds: zlib's inflate state (7,360 B in
# zlib 1.2.13; 16 KiB leaves room for zlib-ng's, allocated aligned) and its 32 KiB window, and the
# gzip module's two buffers of READ_BUFFER_SIZE (its BufferedReader's, and each read of the
# compressed file): 128 KiB since Python 3.12, io.DEFAULT_BUFFER_SIZE (8 KiB) before. Measured
# peaks for a 31-byte .gz: 63 KB on 3.10/3.11, 154 KB on 3.12/3.13, so the bound is computed
# from the running Python's READ_BUFFER_SIZE, not fixed.
GZIP_READER_BYTES = 16 * 1024 + (1 << zlib.MAX_WBITS) + 2 * getattr(gzip, "READ_BUFFER_SIZE", io.DEFAULT_BUFFER_SIZE)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tmp_path_factory.mktemp("idx-fuzz") / "input.idx"


def _reference(data: bytes) -> np.ndarray | None:
    """The array `data` holds, or None if it is not a well-formed IDX file (raw or one gzip stream)."""
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error):
            return None
    if len(data) < 4 or data[0] or data[1] or data[2] not in CODES or not 1 <= data[3] <= 4:
        return None
    ndim, dtype = data[3], np.dtype(CODES[data[2]])
    if len(data) < 4 + 4 * ndim:
        return None
    dims = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    if math.prod(d for d in dims if d) * dtype.itemsize > MAX_PAYLOAD_BYTES:
        return None  # no real file has such a shape (numpy cannot even hold it when empty)
    payload = data[4 + 4 * ndim :]
    if len(payload) != math.prod(dims) * dtype.itemsize:
        return None
    return np.frombuffer(payload, dtype=dtype).reshape(dims)


def _check(path, data: bytes) -> str:
    """Read `data` from `path` and hold the reader to the contract; returns what happened ("read"
    or the defect refused, by DEFECTS' names)."""
    path.write_bytes(data)
    expected = _reference(data)
    tracemalloc.start()
    try:
        try:
            got = read_idx(path)
        except IdxError as exc:
            got = exc
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Reading chunks of at most 1 MiB, never more than the file can hold: a header claiming
    # gigabytes must not show up here. Payload bytes are held at most ~4 times (chunks, their
    # join, the native-order copy); the rest does not depend on the file.
    compressed = data[:2] == b"\x1f\x8b"
    inflated = len(data) * (1032 if compressed else 1)
    bound = 4 * min(inflated, 1 << 20) + READ_OVERHEAD_BYTES + (GZIP_READER_BYTES if compressed else 0)
    assert peak_bytes < bound, f"peak {peak_bytes} B for a {len(data)} B file (bound {bound} B)"
    if isinstance(got, IdxError):
        message = str(got)
        assert isinstance(got, UsageError)
        assert expected is None, f"refused a valid file: {message}"
        assert re.fullmatch(rf"{re.escape(str(path))}: [^\n]+; [^\n]+", message), message
        return next((name for phrase, name in DEFECTS if phrase in message), "other")
    assert expected is not None, f"accepted a malformed file as {got.dtype} {got.shape}"
    assert got.shape == expected.shape and got.dtype == expected.dtype.newbyteorder("=")
    assert got.dtype.isnative and got.flags.writeable
    np.testing.assert_array_equal(got, expected)
    return "read"


def _fuzz(target, inputs, count: int) -> Counter:
    """`_check` each of the first `count` inputs; a failure names the input's index and bytes (what
    reproduces it: `_check(path, bytes.fromhex(...))`). Returns how often each outcome came up."""
    outcomes = Counter()
    for index, data in zip(range(count), inputs):
        try:
            outcomes[_check(target, data)] += 1
        except Exception as exc:
            raise AssertionError(f"input {index} ({len(data)} B): {type(exc).__name__}: {exc}\n"
                                 f"bytes.fromhex({data.hex()!r})") from exc
    return outcomes


# The generators draw from numpy's seeded generator, a few microseconds an input; drawn through
# hypothesis' strategies the same inputs cost ~7 ms each, ten times the check itself. Sizes come
# from small ranges and, a good share of the time, from the edges (U32_EDGES, empty, one byte).


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _size(rng, largest: int) -> int:
    """A length up to `largest`: half the time any, else a small one (0 most often)."""
    return int(rng.integers(0, largest + 1)) if rng.random() < 0.5 else min(largest, int(rng.geometric(0.25)) - 1)


def _u32(rng) -> int:
    """A header number: an IDX dtype code or a uint32 edge, a byte, or any uint32, a third each."""
    pick = rng.integers(3)
    if pick == 0:
        return int(rng.choice(sorted(CODES) + U32_EDGES))
    return int(rng.integers(0, 256 if pick == 1 else 2**32))


def valid_file(rng) -> bytes:
    """A well-formed raw IDX file: any dtype, 1-4 small dims (zero included), random contents."""
    code = int(rng.choice(sorted(CODES)))
    dims = [int(d) for d in rng.integers(0, 7, size=int(rng.integers(1, 5)))]
    payload = rng.bytes(math.prod(dims) * np.dtype(CODES[code]).itemsize)
    return bytes([0, 0, code, len(dims)]) + struct.pack(f">{len(dims)}I", *dims) + payload


def _mutate(data: bytearray, kind: str, position: int, value: int) -> None:
    """One header or framing edit, in place."""
    if kind == "magic":  # one of the 4 magic bytes: zeros, dtype code, ndim
        data[position % min(4, len(data))] = value & 0xFF
    elif kind == "dim" and len(data) >= 8:  # a whole big-endian uint32 dimension
        index = position % ((len(data) - 4) // 4)
        data[4 + 4 * index : 8 + 4 * index] = struct.pack(">I", value)
    elif kind == "byte":  # any byte, header or payload
        data[position % len(data)] = value & 0xFF
    elif kind == "cut":  # truncation, inside the header or the payload
        del data[position % (len(data) + 1) :]
    elif kind == "extra":  # 1-8 trailing bytes
        data += struct.pack(">II", value, position)[: 1 + position % 8]


def mutated_file(rng) -> bytes:
    """A valid file with 1-3 edits (magic, a dimension, any byte, a cut, trailing bytes)."""
    data = bytearray(valid_file(rng))
    for _ in range(int(rng.integers(1, 4))):
        if data:
            kind = str(rng.choice(["magic", "dim", "byte", "cut", "extra"]))
            _mutate(data, kind, int(rng.integers(0, 256)), _u32(rng))
    return bytes(data)


def random_bytes(rng):
    while True:  # random bytes, raw, behind the IDX magic's zeros, or behind gzip's magic
        prefix = [b"", b"\x00\x00", b"\x1f\x8b"][int(rng.integers(3))]
        yield prefix + rng.bytes(_size(rng, 64 if prefix else 200))


def mutated_raw(rng):
    while True:
        yield mutated_file(rng)


def mutated_gzip_wrapped(rng):
    while True:
        yield gzip.compress(mutated_file(rng), compresslevel=int(rng.choice([0, 1, 9])), mtime=0)


def lying_headers(rng):
    # From 10**6 elements (10**12 with 10**6 x 10**6) up to ~2**131 bytes claimed behind at most 2 KiB.
    while True:
        code = int(rng.choice(sorted(CODES)))
        first = int(rng.choice([10**6, 10**9, 2**31, 2**32 - 1])) if rng.random() < 0.5 else int(
            rng.integers(10**6, 2**32))
        dims = [first, *(int(d) for d in rng.choice([1, 28, 1000, 60000, 10**6, 2**32 - 1], size=_size(rng, 3)))]
        data = bytes([0, 0, code, len(dims)]) + struct.pack(f">{len(dims)}I", *dims) + bytes(_size(rng, 2048))
        yield gzip.compress(data, mtime=0) if rng.random() < 0.5 else data


GZIP_TAILS = [b"", b"\x00" * 7, b"junk", b"\x1f\x8b", gzip.compress(b"\x00\x00\x08\x01\x00\x00\x00\x00")]


def damaged_gzip_streams(rng):
    # Edits land anywhere in the .gz (10-byte header, deflate stream, CRC32 + ISIZE trailer); the
    # cut removes bytes from the end; the tail appends zero padding, garbage or another member.
    while True:
        stream = bytearray(gzip.compress(valid_file(rng), mtime=0))
        for _ in range(_size(rng, 3)):
            stream[int(rng.integers(0, 10**6)) % len(stream)] = int(rng.integers(0, 256))
        cut = int(rng.integers(0, 41)) if rng.random() < 0.5 else 0
        if cut:
            del stream[-cut:]
        yield bytes(stream) + GZIP_TAILS[int(rng.integers(len(GZIP_TAILS)))]


def test_random_bytes(target):
    outcomes = _fuzz(target, random_bytes(_rng(1)), 2000)
    assert {"empty", "magic", "dtype code", "ndim", "corrupt gzip", "truncated"} <= outcomes.keys(), outcomes


def test_mutated_headers_raw(target):
    outcomes = _fuzz(target, mutated_raw(_rng(2)), 3000)
    assert {"read", "magic", "dtype code", "ndim", "header cut short", "claim over the limit", "truncated",
            "trailing bytes"} <= outcomes.keys(), outcomes


def test_mutated_headers_gzip_wrapped(target):
    outcomes = _fuzz(target, mutated_gzip_wrapped(_rng(3)), 2500)
    assert {"read", "empty", "magic", "dtype code", "ndim", "header cut short", "claim over the limit",
            "claim beyond the gzip's size", "truncated", "trailing bytes"} <= outcomes.keys(), outcomes


def test_lying_header_claims_far_more_than_the_file_holds(target):
    outcomes = _fuzz(target, lying_headers(_rng(4)), 1000)
    assert {"claim over the limit", "claim beyond the gzip's size", "truncated"} <= outcomes.keys(), outcomes


def test_damaged_gzip_streams(target):
    outcomes = _fuzz(target, damaged_gzip_streams(_rng(5)), 2000)
    assert {"read", "truncated", "corrupt gzip", "trailing bytes"} <= outcomes.keys(), outcomes
