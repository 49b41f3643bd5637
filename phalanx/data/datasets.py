"""`load_dataset`: one call from a dataset name (or none) to an in-memory `ImageDataset`.

This is the policy layer over the loaders: which names exist, that an unnamed dataset means
Fashion-MNIST *by default* (and so may quietly become scikit-learn's digits, with a log line, on
a machine that is offline and has no cached copy), while a dataset the user named explicitly
never changes under them: failing to get it is a `UsageError` that says how to supply it. A
failed download is remembered for RETRY_AFTER_S in the cache (FAILED_NOTE): a default run within
that time falls back at once, in one line, instead of trying the mirrors again on every run;
naming `--dataset fashion-mnist` always tries, and a download that succeeds forgets the failure.
A cache that cannot be written is not downloaded into (nothing could be kept, nor the failure
remembered): the fallback's line says so and names PHALANX_DATA_DIR.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Callable, Sequence

from phalanx.atomic import atomic_write_bytes
from phalanx.data.digits import load_digits_dataset
from phalanx.data.fashion_mnist import (CACHE_ENV_VAR, MIRRORS, CacheUnwritable, FashionMnistUnavailable, Fetch,
                                        cache_dir_for, load_fashion_mnist)
from phalanx.data.image_dataset import ImageDataset
from phalanx.data.synthetic import DEFAULT_SIZES, load_synthetic_dataset
from phalanx.errors import UsageError

DATASET_NAMES = ("fashion-mnist", "digits", "synthetic")
DEFAULT_DATASET = "fashion-mnist"
RETRY_AFTER_S = 3600.0
FAILED_NOTE = "download-failed.json"  # in the cache: when the download last failed, and why


def load_dataset(
    name: str | None,
    data_dir: str | os.PathLike | None,
    *,
    cache_dir: str | os.PathLike | None = None,
    download: bool = True,
    log: Callable[[str], None] = print,
    synthetic_sizes: tuple[int, int] = DEFAULT_SIZES,
    fetch: Fetch | None = None,
    mirrors: Sequence[str] = MIRRORS,
) -> ImageDataset:
    """Load `name` ("fashion-mnist", "digits", "synthetic"; None = the default, fashion-mnist).

    `data_dir` is read only for Fashion-MNIST. `fetch` (url -> bytes) and `mirrors` replace the
    network, for tests and air-gapped mirrors.
    """
    explicit = name is not None
    key = (name or DEFAULT_DATASET).strip().lower().replace("_", "-")
    if key not in DATASET_NAMES:
        raise UsageError(f"unknown dataset {name!r}; choose one of {', '.join(DATASET_NAMES)}")
    if key == "digits":
        return load_digits_dataset()
    if key == "synthetic":
        n_train, n_test = synthetic_sizes
        if n_train < 1 or n_test < 1:
            raise UsageError(f"synthetic dataset sizes must be at least 1, got {n_train} train / {n_test} test; "
                             "pass positive sizes")
        return load_synthetic_dataset((n_train, n_test))
    try:
        cache = cache_dir_for(cache_dir) if data_dir is None else None
        failed_s_ago = None if explicit or cache is None or not download else _recent_failure(cache)
        data = load_fashion_mnist(data_dir, cache_dir=cache, download=download and failed_s_ago is None,
                                  fetch=fetch, mirrors=mirrors, log=log)
    except FashionMnistUnavailable as exc:
        unwritable = isinstance(exc, CacheUnwritable)
        fix = f"set {CACHE_ENV_VAR} to a writable folder" if unwritable else \
            f"put the four official .gz files in {exc.cache_dir}"
        if explicit:
            raise UsageError(f"cannot download Fashion-MNIST ({exc.reason}); {fix} or pass --data-dir DIR") from None
        if unwritable:
            log(f"fashion-mnist is not cached and {exc.reason}; training on scikit-learn's digits instead ({fix}, or "
                "pass --data-dir to use your own copy)")
            return load_digits_dataset()
        if failed_s_ago is not None:
            why = (f"its download failed {_duration(failed_s_ago)} ago and is tried again after "
                   f"{_duration(RETRY_AFTER_S)}, or now with --dataset fashion-mnist")
        else:
            why = exc.brief
            if download:
                _remember_failure(cache, exc.reason)
        # Not asked for by name: a run that trains on real images beats one that stops offline.
        log(f"fashion-mnist is not cached and cannot be downloaded ({why}); training on scikit-learn's "
            "digits instead (pass --data-dir to use your own copy)")
        return load_digits_dataset()
    if data_dir is None:
        with contextlib.suppress(OSError):
            (cache / FAILED_NOTE).unlink(missing_ok=True)
    return data


def _recent_failure(cache: Path) -> float | None:
    """Seconds since a download into `cache` failed, when that is under RETRY_AFTER_S; else None."""
    try:
        age_s = time.time() - float(json.loads((cache / FAILED_NOTE).read_text())["failed_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none, or unreadable: try the download
    return age_s if 0 <= age_s < RETRY_AFTER_S else None


def _remember_failure(cache: Path, reason: str) -> None:
    created = not cache.exists()
    try:
        cache.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(cache / FAILED_NOTE, json.dumps({"failed_at": time.time(), "reason": reason}).encode())
    except OSError:  # an unwritable cache: every run tries again, and leaves nothing behind
        if created:
            with contextlib.suppress(OSError):
                cache.rmdir()


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:g} h" if seconds >= 3600 else f"{seconds // 60:.0f} min" if seconds >= 60 else \
        f"{seconds:.0f} s"
