"""Datasets: the real sample directory, user-directory errors, download/verify/cache, fallback, digits, synthetic.

LeNet learning the real sample is tests/distributed/test_one_device_jobs.py's."""

from __future__ import annotations

import ast
import hashlib
import os
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch

from phalanx.data import ImageDataset, load_dataset, to_float, write_idx
from phalanx.data import fashion_mnist
from phalanx.errors import UsageError

STEMS = fashion_mnist.FILES


def _fixture_arrays(n_train=20, n_test=10, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test, dtype=np.uint8),
    }


def _write_dir(directory: Path, arrays: dict, compressed=True) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for stem, array in arrays.items():
        write_idx(directory / (f"{stem}.gz" if compressed else stem), array, gzip=compressed)
    return directory


@pytest.fixture
def mirror(tmp_path, monkeypatch):
    """A directory of four .gz files posing as the official ones (their MD5s patched in)."""
    directory = _write_dir(tmp_path / "mirror", _fixture_arrays())
    sums = {f"{s}.gz": hashlib.md5((directory / f"{s}.gz").read_bytes()).hexdigest() for s in STEMS}
    monkeypatch.setattr(fashion_mnist, "OFFICIAL_MD5", sums)
    return directory


def _fetch_from(directory: Path, calls: list):
    def fetch(url: str) -> bytes:
        calls.append(url)
        return (directory / url.rsplit("/", 1)[-1]).read_bytes()

    return fetch


def _offline(url: str) -> bytes:
    raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")


# --- a user's directory -------------------------------------------------------------------------


def test_real_sample_dir_reads_as_3000_and_1000_images(real_sample_dir):
    data = load_dataset("fashion-mnist", str(real_sample_dir), download=False)
    assert (data.num_train, data.num_test) == (3000, 1000)
    assert data.train_images.shape == (3000, 1, 28, 28) and data.test_images.shape == (1000, 1, 28, 28)
    assert data.train_images.dtype == torch.uint8 and data.train_labels.dtype == torch.int64
    assert set(data.train_labels.unique().tolist()) == set(range(10))
    assert data.name == "fashion-mnist" and str(real_sample_dir) in data.source
    assert int(data.train_images.max()) > 200  # real images, not blank


def test_user_dir_raw_and_gz_mixed(tmp_path):
    arrays = _fixture_arrays()
    directory = tmp_path / "d"
    _write_dir(directory, dict(list(arrays.items())[:2]), compressed=False)
    _write_dir(directory, dict(list(arrays.items())[2:]), compressed=True)
    data = load_dataset(None, directory, download=False)
    assert torch.equal(data.train_images[:, 0], torch.from_numpy(arrays["train-images-idx3-ubyte"]))
    assert torch.equal(data.test_labels, torch.from_numpy(arrays["t10k-labels-idx1-ubyte"]).long())


def test_missing_data_dir(tmp_path):
    with pytest.raises(UsageError, match=r"data dir .*nope does not exist; .* drop --data-dir"):
        load_dataset("fashion-mnist", tmp_path / "nope")


def test_data_dir_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UsageError, match="is not a directory"):
        load_dataset(None, tmp_path / "f")


def test_data_dir_missing_a_file(tmp_path):
    arrays = _fixture_arrays()
    del arrays["t10k-labels-idx1-ubyte"]
    directory = _write_dir(tmp_path / "d", arrays)
    with pytest.raises(UsageError) as info:
        load_dataset("fashion-mnist", directory)
    assert str(info.value) == (
        f"data dir {directory} has no t10k-labels-idx1-ubyte(.gz); put the four Fashion-MNIST files there "
        "or drop --data-dir to download them"
    )


@pytest.mark.parametrize(
    "stem, array, pattern",
    [
        ("train-labels-idx1-ubyte", np.zeros(19, np.uint8), "has 19 labels but train-images-idx3-ubyte.gz has 20"),
        ("t10k-images-idx3-ubyte", np.zeros((10, 27, 27), np.uint8), "10x27x27 uint8 array, not N x 28 x 28"),
        ("t10k-labels-idx1-ubyte", np.full(10, 10, np.uint8), "label 10, outside"),
        ("train-labels-idx1-ubyte", np.zeros((20, 1), np.uint8), "not a list of uint8 labels"),
    ],
)
def test_data_dir_bad_contents(tmp_path, stem, array, pattern):
    arrays = _fixture_arrays()
    arrays[stem] = array
    directory = _write_dir(tmp_path / "d", arrays)
    with pytest.raises(UsageError, match=pattern):
        load_dataset("fashion-mnist", directory)


def test_data_dir_corrupt_file_names_it(tmp_path):
    directory = _write_dir(tmp_path / "d", _fixture_arrays())
    path = directory / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(UsageError, match="train-images-idx3-ubyte.gz"):
        load_dataset(None, directory)


# --- download, verify, cache --------------------------------------------------------------------


def test_download_verifies_and_caches(tmp_path, mirror, monkeypatch):
    cache, calls, logged = tmp_path / "cache", [], []
    data = load_dataset("fashion-mnist", None, cache_dir=cache, fetch=_fetch_from(mirror, calls),
                        mirrors=["https://example.invalid/fm/"], log=logged.append)
    assert data.num_train == 20 and data.num_test == 10
    assert calls == [f"https://example.invalid/fm/{s}.gz" for s in STEMS]
    assert data.data_dir == str(cache)
    assert sorted(p.name for p in cache.iterdir()) == sorted([f"{s}.gz" for s in STEMS] + [fashion_mnist.MARKER_NAME])
    for stem in STEMS:
        assert (cache / f"{stem}.gz").read_bytes() == (mirror / f"{stem}.gz").read_bytes()

    # Second run: served from the cache, no fetch, and no rehash thanks to the marker.
    def no_hash(path):
        raise AssertionError(f"rehashed {path}")

    monkeypatch.setattr(fashion_mnist, "_md5_of", no_hash)
    again = load_dataset("fashion-mnist", None, cache_dir=cache, fetch=_offline, log=logged.append)
    assert torch.equal(again.train_images, data.train_images)


def test_download_with_wrong_bytes_leaves_nothing(tmp_path, mirror):
    cache = tmp_path / "cache"
    with pytest.raises(UsageError, match=r"cannot download Fashion-MNIST \(.*MD5 .* != official .*pass --data-dir DIR"):
        load_dataset("fashion-mnist", None, cache_dir=cache, fetch=lambda url: b"not the file",
                     mirrors=["https://a.invalid/", "https://b.invalid/"], log=lambda _: None)
    assert not cache.exists()  # not even an empty cache directory


def test_bad_first_mirror_falls_through_to_second(tmp_path, mirror):
    calls = []
    good = _fetch_from(mirror, calls)
    fetch = lambda url: b"corrupt" if "bad.invalid" in url else good(url)  # noqa: E731
    data = load_dataset("fashion-mnist", None, cache_dir=tmp_path / "c", fetch=fetch,
                        mirrors=["https://bad.invalid/", "https://good.invalid/"], log=lambda _: None)
    assert data.num_train == 20 and len(calls) == 4


def test_file_url_mirror_uses_real_fetcher(tmp_path, mirror):
    data = load_dataset("fashion-mnist", None, cache_dir=tmp_path / "c", mirrors=[mirror.as_uri() + "/"],
                        log=lambda _: None)
    assert data.num_test == 10


def test_cached_file_failing_md5_is_replaced(tmp_path, mirror):
    cache = _write_dir(tmp_path / "cache", _fixture_arrays(seed=1))  # right names, wrong bytes
    calls, logged = [], []
    data = load_dataset(None, None, cache_dir=cache, fetch=_fetch_from(mirror, calls), log=logged.append)
    assert len(calls) == 4 and any("fails its MD5 check" in line for line in logged)
    assert data.name == "fashion-mnist"
    assert (cache / "t10k-images-idx3-ubyte.gz").read_bytes() == (mirror / "t10k-images-idx3-ubyte.gz").read_bytes()


def test_cache_dir_from_env(tmp_path, mirror, monkeypatch):
    monkeypatch.setenv("PHALANX_DATA_DIR", str(tmp_path / "env-cache"))
    load_dataset("fashion-mnist", None, fetch=_fetch_from(mirror, []), log=lambda _: None)
    assert (tmp_path / "env-cache" / "train-images-idx3-ubyte.gz").is_file()


def test_offline_default_falls_back_to_digits(tmp_path):
    logged = []
    data = load_dataset(None, None, cache_dir=tmp_path / "c", fetch=_offline, log=logged.append)
    assert data.name == "digits" and data.data_dir is None
    line = logged[-1]
    assert line.startswith("fashion-mnist is not cached and cannot be downloaded (")
    assert "Temporary failure in name resolution" in line
    assert line.endswith("); training on scikit-learn's digits instead (pass --data-dir to use your own copy)")


def test_offline_explicit_is_an_error(tmp_path):
    cache = tmp_path / "c"
    with pytest.raises(UsageError) as info:
        load_dataset("fashion-mnist", None, cache_dir=cache, fetch=_offline, log=lambda _: None)
    message = str(info.value)
    assert message.startswith("cannot download Fashion-MNIST (") and "\n" not in message
    assert message.endswith(f"put the four official .gz files in {cache} or pass --data-dir DIR")


def test_download_off_never_fetches(tmp_path):
    def fetch(url):
        raise AssertionError("fetched with download=False")

    with pytest.raises(UsageError, match="downloads are off"):
        load_dataset("fashion-mnist", None, cache_dir=tmp_path / "c", download=False, fetch=fetch)


# --- digits, synthetic, names -------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits() -> ImageDataset:
    return load_dataset("digits", "/ignored")


def test_digits(digits):
    assert (digits.num_train, digits.num_test) == (1437, 360)
    assert digits.train_images.shape == (1437, 1, 28, 28) and digits.train_images.dtype == torch.uint8
    assert digits.train_labels.dtype == torch.int64 and set(digits.test_labels.tolist()) == set(range(10))
    assert int(digits.train_images.max()) == 255 and int(digits.train_images.min()) == 0
    again = load_dataset("digits", None)
    assert torch.equal(again.train_images, digits.train_images) and torch.equal(again.test_labels, digits.test_labels)


def test_digits_are_scikit_learn_s_own_read_without_importing_it(monkeypatch):
    """The bundled CSV read directly holds load_digits' values; where it is not found, load_digits
    itself gives the same data set; and loading the fallback imports no scikit-learn, so the
    environment's start-up variables (KMP_*, which a fork server compares) stay as they were."""
    import sys

    from sklearn.datasets import load_digits

    from phalanx.data import digits as digits_module

    images, targets = digits_module.bundled_digits()
    bunch = load_digits()
    assert images.dtype == bunch.images.dtype and np.array_equal(images, bunch.images)
    assert np.array_equal(targets, bunch.target) and images.shape == (1797, 8, 8)
    for name in [name for name in sys.modules if name.partition(".")[0] == "sklearn"]:
        monkeypatch.delitem(sys.modules, name)  # put back after the test
    for variable in ("KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK"):  # what importing scikit-learn sets
        monkeypatch.delenv(variable, raising=False)
    read = load_dataset("digits", None)
    assert "sklearn" not in sys.modules and not {"KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK"} & set(os.environ)
    monkeypatch.setattr(digits_module, "_bundled_csv", lambda: None)
    imported = load_dataset("digits", None)
    assert "sklearn" in sys.modules  # the fallback did import it
    assert torch.equal(read.train_images, imported.train_images) and torch.equal(read.test_labels, imported.test_labels)
    assert torch.equal(read.test_images, imported.test_images) and torch.equal(read.train_labels, imported.train_labels)


def test_synthetic_deterministic_and_sized():
    a = load_dataset("synthetic", None, synthetic_sizes=(200, 50))
    b = load_dataset("synthetic", None, synthetic_sizes=(200, 50))
    assert (a.num_train, a.num_test) == (200, 50)
    assert torch.equal(a.train_images, b.train_images) and torch.equal(a.test_labels, b.test_labels)
    assert torch.equal(load_dataset("synthetic", None, synthetic_sizes=(100, 50)).test_images, a.test_images)
    full = load_dataset("synthetic", None)
    assert (full.num_train, full.num_test) == (6000, 1000)


def test_synthetic_is_learnable():
    data = load_dataset("synthetic", None, synthetic_sizes=(2000, 500))
    X, Xt = to_float(data.train_images).flatten(1), to_float(data.test_images).flatten(1)
    centroids = torch.stack([X[data.train_labels == c].mean(0) for c in range(10)])
    accuracy = (torch.cdist(Xt, centroids).argmin(1) == data.test_labels).float().mean().item()
    assert accuracy > 0.9  # the labels follow the images (LeNet itself still takes a few epochs)


def test_synthetic_rejects_bad_sizes():
    with pytest.raises(UsageError, match="at least 1"):
        load_dataset("synthetic", None, synthetic_sizes=(0, 10))


def test_unknown_name_lists_choices():
    with pytest.raises(UsageError, match="unknown dataset 'cifar'; choose one of fashion-mnist, digits, synthetic"):
        load_dataset("cifar", None)


def test_to_float():
    x = torch.tensor([0, 51, 255], dtype=torch.uint8)
    torch.testing.assert_close(to_float(x), torch.tensor([0.0, 0.2, 1.0]))
    assert to_float(x, torch.float64).dtype == torch.float64
    with pytest.raises(ValueError):
        to_float(x.float())


def test_to_float_computes_what_cuda_computes():
    """CUDA divides a tensor by a number as a multiplication by the number's reciprocal; to_float
    does that on every device, in the run's dtype (tests/gpu compares the devices bitwise)."""
    x = torch.arange(256, dtype=torch.uint8)
    for dtype in (torch.float32, torch.float64):
        assert torch.equal(to_float(x, dtype), x.to(dtype) * torch.tensor(1 / 255, dtype=dtype))
    assert int((x.float() / 255 != to_float(x)).sum()) == 126  # where the CPU's division rounds otherwise


def test_data_imports_point_downward():
    forbidden = ("phalanx.comm", "phalanx.data_parallel", "phalanx.runtime.world", "phalanx.train", "phalanx.cli")
    for path in (Path(__file__).resolve().parents[2] / "phalanx" / "data").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith(forbidden), f"{path.name} imports {name}"
