"""Fashion-MNIST on disk: read a directory of the four IDX files, or download, verify and cache them.

Two sources, two trust levels. A directory the user names (`--data-dir`) is read as it is: any
subset or re-split is fine, so only the format and the label/image agreement are checked. The
cache (PHALANX_DATA_DIR, else fashion-mnist/ in phalanx's cache: caches.py) holds exactly the
official `.gz` files: each is checked against Zalando's published MD5 once, the result
remembered in a marker file keyed by size and mtime, and a file that fails is deleted and
fetched again. Downloads try the
mirrors in order, verify before anything is written, and write atomically; the cache directory
is created with the first verified file, so a failed download leaves no empty one behind. A
cache that cannot be written is not downloaded into at all (`CacheUnwritable`): nothing fetched
could be kept, and every run would pay the wait again. All the fetching of one call shares one
deadline (DOWNLOAD_DEADLINE_S), and a server or proxy that stays silent fails an attempt after
STALL_TIMEOUT_S. A download says nothing unless it takes more than NOTICE_AFTER_S (then one
line): offline, the mirrors fail at once and the caller's one line is all there is. When the files cannot be had,
`FashionMnistUnavailable` carries the reason; whether that means "fall back" or "error" is the
caller's decision (`phalanx.data.datasets`).
"""

from __future__ import annotations

import functools
import hashlib
import http.client
import json
import os
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable, Sequence

import torch

from phalanx.atomic import atomic_write_bytes
from phalanx.caches import NoCacheHome, cache_root
from phalanx.outdir import check_path_length, write_refusal
from phalanx.data.idx import read_idx
from phalanx.data.image_dataset import ImageDataset
from phalanx.errors import UsageError

FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
# Published in github.com/zalandoresearch/fashion-mnist README ("Get the Data").
OFFICIAL_MD5 = {
    "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
    "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
    "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
    "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
}
# The S3 mirror is plain http; integrity comes from the MD5 check, not the transport.
MIRRORS = (
    "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
    "https://github.com/zalandoresearch/fashion-mnist/raw/master/data/fashion/",
)
# A connection, or a response, that stays silent this long fails its attempt: a dead proxy cost
# 30 s per mirror with a 30 s timeout (a run waited 52 s before training); a live mirror
# answers in well under a second.
STALL_TIMEOUT_S = 5.0
# Every attempt of one ensure_cached shares this: the four files are 30 MB, 30 s at 1 MB/s.
DOWNLOAD_DEADLINE_S = 120.0
MAX_DOWNLOAD_BYTES = 64 * 1024**2  # the largest official file is 26 MB
MARKER_NAME = ".phalanx-md5-verified.json"
CACHE_ENV_VAR = "PHALANX_DATA_DIR"
NOTICE_AFTER_S = 2.0  # a download still going after this long says so, once

Fetch = Callable[[str], bytes]  # url -> the whole response body; raises OSError/ValueError on failure


class FashionMnistUnavailable(Exception):
    """Not cached and not downloadable; `reason` is one clause for the user's message, `brief` a
    shorter one (every mirror's same failure said once)."""

    def __init__(self, reason: str, cache_dir: Path | None, *, brief: str | None = None):
        super().__init__(reason)
        self.reason, self.cache_dir, self.brief = reason, cache_dir, brief or reason


class CacheUnwritable(FashionMnistUnavailable):
    """Files are missing and the cache cannot be written, so no download was tried."""


def fetch_url(url: str, *, deadline: float | None = None) -> bytes:
    """GET `url` (http, https or file), refusing bodies over MAX_DOWNLOAD_BYTES. An attempt fails
    once the connection or the response is silent for STALL_TIMEOUT_S, or past `deadline` (a
    time.monotonic() value): so it ends by the deadline plus at most one stall."""
    chunks, got = [], 0
    with urllib.request.urlopen(url, timeout=_stall_timeout(deadline)) as response:
        # Chunked: a single read(n) would allocate n bytes up front whatever the server sends.
        while chunk := response.read(1 << 20):
            chunks.append(chunk)
            got += len(chunk)
            if got > MAX_DOWNLOAD_BYTES:
                raise ValueError(f"response larger than {MAX_DOWNLOAD_BYTES} bytes")
            _stall_timeout(deadline)  # raises once the deadline has passed
    return b"".join(chunks)


def _stall_timeout(deadline: float | None) -> float:
    """The socket timeout for an attempt: STALL_TIMEOUT_S, less when the deadline is nearer; a
    TimeoutError once it has passed."""
    if deadline is None:
        return STALL_TIMEOUT_S
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"no answer within the {DOWNLOAD_DEADLINE_S:g} s the download may take")
    return min(STALL_TIMEOUT_S, left)


def cache_dir_for(cache_dir: str | os.PathLike | None) -> Path:
    """The cache directory: the argument, else $PHALANX_DATA_DIR, else phalanx's cache
    (caches.py: $XDG_CACHE_HOME/phalanx or ~/.cache/phalanx) / fashion-mnist; CacheUnwritable
    where there is no home for that cache."""
    chosen = cache_dir or os.environ.get(CACHE_ENV_VAR)
    if chosen:
        return Path(chosen).expanduser()
    try:
        return cache_root() / "fashion-mnist"
    except NoCacheHome as exc:
        raise CacheUnwritable(f"there is no home to cache it in ({exc}), so no download was tried", None) from None


def _md5_of(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)  # an integrity check, not security; allowed under FIPS
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _stamp(path: Path, md5: str) -> dict:
    stat = path.stat()
    return {"md5": md5, "size_bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _read_marker(cache: Path) -> dict:
    try:
        marker = json.loads((cache / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return {}  # absent or damaged: every file simply gets hashed again
    return marker if isinstance(marker, dict) else {}


def _verify_cached(cache: Path, marker: dict, log: Callable[[str], None]) -> list[str]:
    """Check each cached .gz (hashing only files the marker does not vouch for); return the missing."""
    missing = []
    for fname, md5 in OFFICIAL_MD5.items():
        path = cache / fname
        if not path.is_file():
            missing.append(fname)
            continue
        # A marker entry counts only while size and mtime match: a replaced file is hashed again.
        if marker.get(fname) == _stamp(path, md5):
            continue
        if _md5_of(path) == md5:
            marker[fname] = _stamp(path, md5)
            continue
        log(f"cached {path} fails its MD5 check; deleting it to download it again")
        marker.pop(fname, None)
        try:
            path.unlink()
        except OSError:
            pass  # unwritable cache: the download below fails and says so
        missing.append(fname)
    return missing


def _download(fname: str, cache: Path, fetch: Fetch, mirrors: Sequence[str], deadline: float) -> None:
    """Fetch one file from the first mirror that serves the right bytes, trying none past
    `deadline` (time.monotonic()); raise with every mirror's reason."""
    failures = []
    for mirror in mirrors:
        url = urllib.parse.urljoin(mirror if mirror.endswith("/") else mirror + "/", fname)
        where = urllib.parse.urlsplit(url).netloc or url
        if time.monotonic() >= deadline:  # no attempt starts past it: the rest would wait as long
            failures.append(f"{where} and on: not tried, no answer within the {DOWNLOAD_DEADLINE_S:g} s the "
                            "download may take")
            break
        try:
            data = fetch(url)
        except (OSError, http.client.HTTPException, ValueError) as exc:  # URLError and timeouts are OSErrors
            failures.append(f"{where}: {getattr(exc, 'reason', None) or exc}")
            continue
        got = hashlib.md5(data, usedforsecurity=False).hexdigest()
        if got != OFFICIAL_MD5[fname]:
            # Verified before writing, so a bad download never reaches the cache, not even as a temp file.
            failures.append(f"{where}: MD5 {got} != official {OFFICIAL_MD5[fname]}")
            continue
        try:
            cache.mkdir(parents=True, exist_ok=True)  # only now: a failed download leaves no empty cache
            # Temp file + rename: ranks sharing one cache may download at once; each rename is
            # atomic and carries the same verified bytes, so no lock is needed.
            atomic_write_bytes(cache / fname, data)
        except OSError as exc:
            raise FashionMnistUnavailable(f"cannot write {cache / fname}: {exc.strerror or exc}", cache) from None
        return
    reasons = {failure.split(": ", 1)[-1] for failure in failures}
    brief = f"{reasons.pop()}, from every mirror" if len(failures) > 1 and len(reasons) == 1 else None
    raise FashionMnistUnavailable(f"{fname}: " + "; ".join(failures or ["no mirrors configured"]), cache, brief=brief)


def ensure_cached(
    cache: Path,
    *,
    download: bool = True,
    fetch: Fetch | None = None,
    mirrors: Sequence[str] = MIRRORS,
    log: Callable[[str], None] = print,
) -> None:
    """Make `cache` hold the four official .gz files, verified; raise FashionMnistUnavailable if it
    cannot (CacheUnwritable, without trying, where nothing downloaded could be saved)."""
    marker = _read_marker(cache) if cache.is_dir() else {}
    before = dict(marker)
    missing = _verify_cached(cache, marker, log) if cache.is_dir() else list(OFFICIAL_MD5)
    deadline = time.monotonic() + DOWNLOAD_DEADLINE_S
    try:
        if missing and not download:
            raise FashionMnistUnavailable(f"downloads are off and {missing[0]} is missing", cache)
        refusal = write_refusal(cache) if missing else None
        if refusal is not None:
            raise CacheUnwritable(f"its cache {cache} cannot be written ({refusal}), so no download was tried", cache)
        notice = threading.Timer(NOTICE_AFTER_S, log, args=(f"downloading Fashion-MNIST ({len(missing)} of "
                                                            f"{len(OFFICIAL_MD5)} files) into {cache}",))
        notice.daemon = True
        if missing:
            notice.start()
        try:
            for fname in missing:
                # Stop at the first file no mirror serves: offline, the rest would fail the same way.
                _download(fname, cache, fetch or functools.partial(fetch_url, deadline=deadline), mirrors, deadline)
                marker[fname] = _stamp(cache / fname, OFFICIAL_MD5[fname])
        finally:
            notice.cancel()
    finally:
        # Record what was verified even if a later file failed, so the next run does not rehash it.
        if marker != before:
            try:
                atomic_write_bytes(cache / MARKER_NAME, json.dumps(marker, indent=1, sort_keys=True).encode())
            except OSError:
                pass  # read-only cache: correctness is unaffected, the next run just hashes again


def _find(directory: Path, stem: str, missing_fix: str) -> Path:
    # .gz first: in the cache it is the file whose checksum was verified.
    for candidate in (directory / f"{stem}.gz", directory / stem):
        if candidate.is_file():
            return candidate
    raise UsageError(missing_fix.format(dir=directory, file=f"{stem}(.gz)"))


def _read_split(directory: Path, prefix: str, missing_fix: str) -> tuple[torch.Tensor, torch.Tensor]:
    images_path = _find(directory, f"{prefix}-images-idx3-ubyte", missing_fix)
    labels_path = _find(directory, f"{prefix}-labels-idx1-ubyte", missing_fix)
    images, labels = read_idx(images_path), read_idx(labels_path)  # IdxError names file and fix
    if images.ndim != 3 or images.shape[1:] != (28, 28) or images.dtype != "uint8":
        raise UsageError(f"{images_path} holds a {'x'.join(map(str, images.shape))} {images.dtype} array, "
                         "not N x 28 x 28 uint8 images; replace it with the Fashion-MNIST file of that name")
    if labels.ndim != 1 or labels.dtype != "uint8":
        raise UsageError(f"{labels_path} holds a {'x'.join(map(str, labels.shape))} {labels.dtype} array, "
                         "not a list of uint8 labels; replace it with the Fashion-MNIST file of that name")
    if labels.shape[0] != images.shape[0]:
        raise UsageError(f"{labels_path} has {labels.shape[0]} labels but {images_path.name} has {images.shape[0]} "
                         "images; the two files do not belong together, replace them with a matching pair")
    if images.shape[0] == 0:  # would "train" without a step and report loss 0, or evaluate nothing
        split = "training" if prefix == "train" else "test"
        raise UsageError(f"{images_path} holds 0 images; a {split} set needs at least one, "
                         "replace it (and its labels) with a non-empty pair")
    if labels.size and labels.max() > 9:
        raise UsageError(f"{labels_path} has label {int(labels.max())}, outside Fashion-MNIST's 0..9; "
                         "replace it with the Fashion-MNIST file of that name")
    # [N,28,28] -> [N,1,28,28]: one channel, as the book's LeNet expects.
    return torch.from_numpy(images).unsqueeze(1), torch.from_numpy(labels).to(torch.int64)


def read_fashion_mnist_dir(
    directory: str | os.PathLike, *, source: str = "", missing_fix: str | None = None
) -> ImageDataset:
    """The four files in `directory` (each raw or .gz) as an ImageDataset; no checksum check."""
    directory = Path(directory).expanduser()
    missing_fix = missing_fix or "{dir} has no {file}; put the four Fashion-MNIST files there"
    train_images, train_labels = _read_split(directory, "train", missing_fix)
    test_images, test_labels = _read_split(directory, "t10k", missing_fix)
    return ImageDataset(
        name="fashion-mnist",
        train_images=train_images,
        train_labels=train_labels,
        test_images=test_images,
        test_labels=test_labels,
        source=source or str(directory),
        data_dir=str(directory),
    )


def load_fashion_mnist(
    data_dir: str | os.PathLike | None,
    *,
    cache_dir: str | os.PathLike | None = None,
    download: bool = True,
    fetch: Fetch | None = None,
    mirrors: Sequence[str] = MIRRORS,
    log: Callable[[str], None] = print,
) -> ImageDataset:
    """Fashion-MNIST from `data_dir` if given, else from the verified cache (downloading into it)."""
    if data_dir is not None:
        check_path_length(data_dir, flag="--data-dir")  # a name too long: one line, not an OSError
        directory = Path(data_dir).expanduser()
        if not directory.exists():
            raise UsageError(f"data dir {directory} does not exist; create it with the four Fashion-MNIST files "
                             "or drop --data-dir to download them")
        if not directory.is_dir():
            raise UsageError(f"data dir {directory} is not a directory; pass the folder that holds the four "
                             "Fashion-MNIST files, or drop --data-dir to download them")
        return read_fashion_mnist_dir(
            directory,
            missing_fix="data dir {dir} has no {file}; put the four Fashion-MNIST files there "
            "or drop --data-dir to download them",
        )
    cache = cache_dir_for(cache_dir)
    ensure_cached(cache, download=download, fetch=fetch, mirrors=mirrors, log=log)
    return read_fashion_mnist_dir(cache, source=f"{cache} (official files, MD5 verified)")
