"""Fuzzing the IDX reader (issue 4): 10,500 generated files, each read exactly right or refused cleanly.

Every example writes one file and checks `read_idx` against `_reference`, a decoder written here
from the format's description (http://yann.lecun.com/exdb/mnist/, "FILE FORMATS"; gzip through
`gzip.decompress`, a separate code path from the reader's streaming one):

- the reader returns an array exactly when the reference decodes one, with the header's shape,
  the declared dtype (native byte order, writable) and the same values;
- otherwise it raises `IdxError` (a `UsageError`) whose one-line message names the file, the
  defect and, after "; ", the fix; any other exception fails the test;
- a lying header allocates nothing big: tracemalloc's peak during the call stays within a small
  multiple of what the file really holds, whatever size the header claims, plus what reading
  costs whatever the file holds (`READ_OVERHEAD_BYTES`, `GZIP_READER_BYTES`: the gzip module's
  buffers grew 16-fold in Python 3.12, so that part is computed from the running Python).

Inputs: random bytes (raw and behind gzip magic), valid files with mutated magic, dtype code, ndim,
dims, truncation and extra bytes (raw and gzip-wrapped), headers claiming up to ~2**128 bytes,
and damaged gzip streams (deflate bytes, flags, CRC/length trailer, cuts, padding, extra members).
Deterministic (derandomize, no example database), so CI sees the same 10,500 inputs every run.
"""

from __future__ import annotations

import gzip
import io
import math
import re
import struct
import tracemalloc
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from phalanx.data.idx import MAX_PAYLOAD_BYTES, IdxError, read_idx
from phalanx.errors import UsageError

CODES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
# Message phrase -> defect name, for the statistics only (first match wins).
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
# peaks for a 31-byte .gz: 63 KB on 3.10/3.11, 154 KB on 3.12/3.13 (issue 11: a fixed bound
# failed on 3.12 for a 25-byte file).
GZIP_READER_BYTES = 16 * 1024 + (1 << zlib.MAX_WBITS) + 2 * getattr(gzip, "READ_BUFFER_SIZE", io.DEFAULT_BUFFER_SIZE)


def _fuzz(max_examples: int):
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


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


def _check(path, data: bytes) -> None:
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
        # --hypothesis-show-statistics tallies which defects the inputs reached.
        event("refused: " + next((name for phrase, name in DEFECTS if phrase in message), "other"))
        return
    event("read")
    assert expected is not None, f"accepted a malformed file as {got.dtype} {got.shape}"
    assert got.shape == expected.shape and got.dtype == expected.dtype.newbyteorder("=")
    assert got.dtype.isnative and got.flags.writeable
    np.testing.assert_array_equal(got, expected)


# Strategies are built once, here: building them inside a composite per example costs more than
# the reader itself. Payloads come from a drawn seed, not drawn byte by byte, for the same reason.
_PAYLOAD_SEED = st.integers(0, 2**32 - 1)
_DTYPE_CODE = st.sampled_from(sorted(CODES))
_DIMS = st.lists(st.integers(0, 6), min_size=1, max_size=4)
_MUTATION = st.tuples(
    st.sampled_from(["magic", "dim", "byte", "cut", "extra"]),
    st.integers(0, 255),  # which byte / dimension, taken modulo what the file has
    st.one_of(st.sampled_from(sorted(CODES) + U32_EDGES), st.integers(0, 255), st.integers(0, 2**32 - 1)),
)


@st.composite
def valid_files(draw) -> bytes:
    """A well-formed raw IDX file: any dtype, 1-4 small dims (zero included), random contents."""
    code, dims = draw(_DTYPE_CODE), draw(_DIMS)
    count = math.prod(dims) * np.dtype(CODES[code]).itemsize
    payload = np.random.default_rng(draw(_PAYLOAD_SEED)).bytes(count)
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


@st.composite
def mutated_files(draw) -> bytes:
    data = bytearray(draw(valid_files()))
    for kind, position, value in draw(st.lists(_MUTATION, min_size=1, max_size=3)):
        if data:
            _mutate(data, kind, position, value)
    return bytes(data)


@_fuzz(2000)
@given(data=st.one_of(st.binary(max_size=200), st.binary(max_size=64).map(lambda b: b"\x00\x00" + b),
                      st.binary(max_size=64).map(lambda b: b"\x1f\x8b" + b)))
def test_random_bytes(target, data):
    _check(target, data)


@_fuzz(3000)
@given(data=mutated_files())
def test_mutated_headers_raw(target, data):
    _check(target, data)


@_fuzz(2500)
@given(data=mutated_files(), level=st.sampled_from([0, 1, 9]))
def test_mutated_headers_gzip_wrapped(target, data, level):
    _check(target, gzip.compress(data, compresslevel=level, mtime=0))


@_fuzz(1000)
@given(code=st.sampled_from(sorted(CODES)),
       first=st.one_of(st.sampled_from([10**6, 10**9, 2**31, 2**32 - 1]), st.integers(10**6, 2**32 - 1)),
       rest=st.lists(st.sampled_from([1, 28, 1000, 60000, 10**6, 2**32 - 1]), max_size=3),
       payload_bytes=st.integers(0, 2048), compressed=st.booleans())
def test_lying_header_claims_far_more_than_the_file_holds(target, code, first, rest, payload_bytes, compressed):
    # From 10**6 elements (10**12 with 10**6 x 10**6) up to ~2**131 bytes claimed behind at most 2 KiB.
    dims = [first, *rest]
    data = bytes([0, 0, code, len(dims)]) + struct.pack(f">{len(dims)}I", *dims) + bytes(payload_bytes)
    _check(target, gzip.compress(data, mtime=0) if compressed else data)


@_fuzz(2000)
@given(data=valid_files(), edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=3),
       cut=st.one_of(st.none(), st.integers(0, 40)),
       tail=st.sampled_from([b"", b"\x00" * 7, b"junk", b"\x1f\x8b", gzip.compress(b"\x00\x00\x08\x01\x00\x00\x00\x00")]))
def test_damaged_gzip_streams(target, data, edits, cut, tail):
    # Edits land anywhere in the .gz (10-byte header, deflate stream, CRC32 + ISIZE trailer); the
    # cut removes bytes from the end; the tail appends zero padding, garbage or another member.
    stream = bytearray(gzip.compress(data, mtime=0))
    for position, value in edits:
        stream[position % len(stream)] = value
    if cut:
        del stream[-cut:]
    _check(target, bytes(stream) + tail)
