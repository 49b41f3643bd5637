"""Read and write IDX files, the array format Fashion-MNIST (and MNIST) ships in.

An IDX file is a 4-byte magic (two zero bytes, a dtype code, the number of dimensions), one
big-endian uint32 per dimension, then the array itself, big-endian, row-major
(http://yann.lecun.com/exdb/mnist/, "FILE FORMATS"). `read_idx` accepts the file raw or gzipped,
recognising gzip by its magic bytes rather than the file name, and trusts nothing in the header:
a claimed size is checked against the file's size before any payload is read (for gzip, against
deflate's 1032:1 ceiling), decompression is streamed and stops one byte past the claim, and
memory grows only with bytes actually read. A corrupt or hostile header can neither make it
allocate gigabytes nor slip truncated or padded data through. Every defect is an `IdxError` (a
`UsageError`) naming the file, what is wrong and what to do; tests/unit/test_idx_fuzz.py checks
that no other exception escapes. `write_idx` is the inverse, used by tests; it writes atomically.
"""

from __future__ import annotations

import gzip as _gzip
import math
import os
import stat
import struct
import zlib
from pathlib import Path

import numpy as np

from phalanx.atomic import atomic_write_bytes
from phalanx.errors import UsageError

# dtype code -> big-endian numpy dtype, from the IDX specification.
_CODE_TO_DTYPE = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_DTYPE_TO_CODE = {(dt.kind, dt.itemsize): code for code, dt in _CODE_TO_DTYPE.items()}

MAX_PAYLOAD_BYTES = 2 * 1024**3  # the full Fashion-MNIST is 47 MB; anything past 2 GiB is a bad header
_GZIP_MAGIC = b"\x1f\x8b"
_CHUNK_BYTES = 1 << 20  # read in chunks: one read(n) of a BufferedReader pre-allocates all n bytes
# Deflate emits at most 258 bytes per ~2 bits (a longest match at the shortest codes), so no gzip
# stream inflates more than 1032-fold (zlib FAQ, "What's the maximum compression ratio?").
MAX_DEFLATE_RATIO = 1032


class IdxError(UsageError):
    """An IDX file that cannot be used: the message names the file, the defect and the fix."""


def _read_at_most(stream, limit: int) -> bytes:
    """Up to `limit` bytes from `stream`; memory grows with the bytes actually there, not `limit`."""
    chunks, got = [], 0
    while got < limit:
        chunk = stream.read(min(_CHUNK_BYTES, limit - got))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _shape_text(dims: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in dims)


def _parse(path: Path, stream, *, compressed: bool, size_bytes: int) -> np.ndarray:
    """Header, bounds checks, then the payload; `stream` is the raw file or a gzip reader over it.

    `size_bytes` is the file's size on disk: for a raw file the exact room for header + payload,
    for a gzip file the base of an upper bound on what it can inflate to.
    """
    where = "decompressed data" if compressed else "file"
    magic = _read_at_most(stream, 4)
    if len(magic) == 0:
        raise IdxError(f"{path}: empty {where} (0 bytes); re-download it")
    if len(magic) < 4 or magic[0] != 0 or magic[1] != 0:
        found = " ".join(f"{b:02x}" for b in magic)
        raise IdxError(
            f"{path}: not an IDX file (starts with {found}, expected 00 00 <dtype> <ndim>); "
            "point to the Fashion-MNIST IDX file, raw or .gz"
        )
    code, ndim = magic[2], magic[3]
    if code not in _CODE_TO_DTYPE:
        raise IdxError(
            f"{path}: unknown IDX dtype code 0x{code:02x} (expected one of "
            f"{', '.join(f'0x{c:02x}' for c in _CODE_TO_DTYPE)}); the file is corrupt, re-download it"
        )
    if not 1 <= ndim <= 4:
        raise IdxError(f"{path}: IDX header says {ndim} dimensions (supported: 1 to 4); "
                       "the file is corrupt, re-download it")
    header_bytes = 4 + 4 * ndim
    dims_bytes = _read_at_most(stream, 4 * ndim)
    if len(dims_bytes) < 4 * ndim:
        raise IdxError(f"{path}: truncated inside the header ({ndim} dimensions need {4 * ndim} bytes, "
                       f"{where} has {len(dims_bytes)}); re-download it")
    dims = struct.unpack(f">{ndim}I", dims_bytes)
    dtype = _CODE_TO_DTYPE[code]
    # Python ints: the product cannot overflow, however large the header's numbers are.
    claimed_bytes = math.prod(dims) * dtype.itemsize
    # A zero dimension empties the array, but numpy still refuses a shape whose other dimensions
    # multiply past its index range ("array is too big"): bound those too.
    extent_bytes = math.prod(d for d in dims if d) * dtype.itemsize
    claim = f"{_shape_text(dims)} {dtype.name} = {claimed_bytes} bytes"
    if max(claimed_bytes, extent_bytes) > MAX_PAYLOAD_BYTES:
        zero_note = "" if claimed_bytes > MAX_PAYLOAD_BYTES else " (its nonzero dimensions alone)"
        raise IdxError(f"{path}: header says {claim}, over the {MAX_PAYLOAD_BYTES} byte limit{zero_note}; "
                       "the header is corrupt, re-download the file")
    # Judge the claim by the file's size before reading any payload.
    if not compressed and size_bytes - header_bytes != claimed_bytes:
        _raise_size_mismatch(path, claim, where, size_bytes - header_bytes, claimed_bytes)
    if compressed and header_bytes + claimed_bytes > size_bytes * MAX_DEFLATE_RATIO:
        raise IdxError(f"{path}: truncated: header says {claim}, more than a {size_bytes}-byte gzip file "
                       f"can inflate to ({MAX_DEFLATE_RATIO}x at most); re-download it")
    # One byte past the claim is enough to tell "exact" from "trailing data" without reading it all
    # (a gzip bomb behind a small header stops here; so does a raw file that grew since the stat).
    payload = _read_at_most(stream, claimed_bytes + 1)
    if len(payload) != claimed_bytes:
        _raise_size_mismatch(path, claim, where, len(payload), claimed_bytes)
    # astype copies into native byte order: a writable array that torch.from_numpy accepts.
    return np.frombuffer(payload, dtype=dtype).reshape(dims).astype(dtype.newbyteorder("="))


def _raise_size_mismatch(path: Path, claim: str, where: str, found_bytes: int, claimed_bytes: int) -> None:
    if found_bytes < claimed_bytes:
        raise IdxError(f"{path}: truncated: header says {claim}, "
                       f"{where} has {found_bytes} bytes after the header; re-download it")
    raise IdxError(f"{path}: trailing bytes after the {claim} the header describes; "
                   "the file is corrupt or not what its header says, re-download it")


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """The array stored in the IDX file at `path` (raw or gzip), in native byte order."""
    path = Path(path)
    try:
        # stat before open: opening a FIFO would block, and a device file (/dev/zero) never ends.
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise IdxError(f"{path}: not a regular file; point to the IDX file itself")
        f = open(path, "rb")
    except FileNotFoundError:
        raise IdxError(f"{path}: no such file; check the path") from None
    except PermissionError:
        raise IdxError(f"{path}: permission denied; make it readable (chmod a+r) or copy it "
                       "somewhere you can read") from None
    except OSError as exc:
        raise IdxError(f"{path}: cannot open ({exc.strerror or exc}); check the path and its permissions") from None
    with f:
        size_bytes = os.fstat(f.fileno()).st_size
        try:
            compressed = f.read(2) == _GZIP_MAGIC
            f.seek(0)
            if not compressed:
                return _parse(path, f, compressed=False, size_bytes=size_bytes)
            with _gzip.GzipFile(fileobj=f, mode="rb") as gz:
                return _parse(path, gz, compressed=True, size_bytes=size_bytes)
        except EOFError:  # the gzip stream stops mid-way: an interrupted download or copy
            raise IdxError(f"{path}: truncated: the gzip stream ends before its end marker; re-download it") from None
        except (_gzip.BadGzipFile, zlib.error) as exc:  # bad gzip header, deflate data, CRC or length
            raise IdxError(f"{path}: corrupt gzip data ({exc}); re-download it") from None
        except OSError as exc:  # an I/O error while reading (EIO, a vanished network mount)
            raise IdxError(f"{path}: cannot read ({exc.strerror or exc}); check the disk, then re-download it") from None


def write_idx(path: str | os.PathLike, array, gzip: bool) -> None:
    """Write `array` (1 to 4 dims, an IDX dtype) to `path` as IDX, gzipped if `gzip`, atomically."""
    array = np.asarray(array)
    code = _DTYPE_TO_CODE.get((array.dtype.kind, array.dtype.itemsize))
    if code is None:
        raise ValueError(f"write_idx: dtype {array.dtype} has no IDX code; "
                         "use uint8, int8, int16, int32, float32 or float64")
    if not 1 <= array.ndim <= 4:
        raise ValueError(f"write_idx: array has {array.ndim} dimensions; IDX files here hold 1 to 4")
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    body = header + np.ascontiguousarray(array, dtype=_CODE_TO_DTYPE[code]).tobytes()
    if gzip:
        body = _gzip.compress(body, mtime=0)  # mtime=0: same array, same bytes
    atomic_write_bytes(path, body)
