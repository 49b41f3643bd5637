"""A first run offline: one line about the missing download and no empty cache
directory; the failure is remembered for an hour, so later default runs fall back at once without
trying the mirrors, unless --dataset fashion-mnist is named; a download that succeeds forgets it;
a slow download says what it is doing, once. The network is simulated (tests/unit/test_data_*.py);
the command itself run offline, twice, is tests/distributed/test_one_device_jobs.py's."""

from __future__ import annotations

import json
import re
import time
import urllib.error

import pytest

from phalanx.data import datasets, fashion_mnist, load_dataset
from phalanx.errors import UsageError
from tests.unit.test_data_datasets import _fetch_from, mirror  # noqa: F401 - the fixture, reused

FALLBACK = "fashion-mnist is not cached and cannot be downloaded ("
DIGITS = "); training on scikit-learn's digits instead (pass --data-dir to use your own copy)"


class Offline:
    """The network as a machine without one sees it: every URL fails at once; counts the tries."""

    def __init__(self) -> None:
        self.urls: list[str] = []

    def __call__(self, url: str, **kwargs) -> bytes:  # kwargs: fetch_url's (its deadline), when it stands in for it
        self.urls.append(url)
        raise urllib.error.URLError("[Errno -2] Name or service not known")


def test_offline_first_run_is_one_line_and_leaves_no_empty_directory(tmp_path):
    cache, offline, logged = tmp_path / "cache", Offline(), []
    data = load_dataset(None, None, cache_dir=cache, fetch=offline, log=logged.append)
    assert data.name == "digits" and len(offline.urls) == 2  # both mirrors, first file only
    assert logged == [f"{FALLBACK}[Errno -2] Name or service not known, from every mirror{DIGITS}"]
    assert [p.name for p in cache.iterdir()] == [datasets.FAILED_NOTE]  # the failure, remembered
    note = json.loads((cache / datasets.FAILED_NOTE).read_text())
    assert "Name or service not known" in note["reason"] and time.time() - note["failed_at"] < 60


def test_a_remembered_failure_falls_back_at_once_for_an_hour(tmp_path, monkeypatch):
    cache, offline = tmp_path / "cache", Offline()
    load_dataset(None, None, cache_dir=cache, fetch=offline, log=lambda _: None)
    tried = len(offline.urls)
    logged = []
    assert load_dataset(None, None, cache_dir=cache, fetch=offline, log=logged.append).name == "digits"
    assert len(offline.urls) == tried  # no download attempt
    assert len(logged) == 1 and re.fullmatch(re.escape(FALLBACK) + r"its download failed \d+ s ago and is tried again "
                                             r"after 1 h, or now with --dataset fashion-mnist" + re.escape(DIGITS),
                                             logged[0]), logged
    with pytest.raises(UsageError, match=r"^cannot download Fashion-MNIST \("):  # named: always tried
        load_dataset("fashion-mnist", None, cache_dir=cache, fetch=offline, log=lambda _: None)
    assert len(offline.urls) == tried + 2
    an_hour_later = time.time() + datasets.RETRY_AFTER_S + 1
    monkeypatch.setattr(datasets.time, "time", lambda: an_hour_later)
    load_dataset(None, None, cache_dir=cache, fetch=offline, log=lambda _: None)
    assert len(offline.urls) == tried + 4  # an hour on: tried again


def test_a_download_that_succeeds_forgets_the_failure(tmp_path, mirror):  # noqa: F811
    cache = tmp_path / "cache"
    load_dataset(None, None, cache_dir=cache, fetch=Offline(), log=lambda _: None)
    data = load_dataset("fashion-mnist", None, cache_dir=cache, fetch=_fetch_from(mirror, []), log=lambda _: None)
    assert data.name == "fashion-mnist" and not (cache / datasets.FAILED_NOTE).exists()


def test_files_put_in_the_cache_are_used_despite_a_remembered_failure(tmp_path, mirror):  # noqa: F811
    cache = tmp_path / "cache"
    load_dataset(None, None, cache_dir=cache, fetch=Offline(), log=lambda _: None)
    for path in mirror.iterdir():  # what the fallback line suggests: put the files there
        (cache / path.name).write_bytes(path.read_bytes())
    assert load_dataset(None, None, cache_dir=cache, fetch=Offline(), log=lambda _: None).name == "fashion-mnist"


def test_a_slow_download_says_so_once(tmp_path, mirror, monkeypatch):  # noqa: F811
    monkeypatch.setattr(fashion_mnist, "NOTICE_AFTER_S", 0.05)
    fast = _fetch_from(mirror, [])

    def slow(url: str) -> bytes:
        time.sleep(0.1)
        return fast(url)

    logged = []
    load_dataset(None, None, cache_dir=tmp_path / "cache", fetch=slow, log=logged.append)
    assert logged == [f"downloading Fashion-MNIST (4 of 4 files) into {tmp_path / 'cache'}"]


def test_every_cache_follows_xdg_cache_home_and_phalanx_data_dir_wins_for_the_data(tmp_path, monkeypatch):
    from phalanx.comm import shm_kernel

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(fashion_mnist.CACHE_ENV_VAR, raising=False)
    assert fashion_mnist.cache_dir_for(None) == tmp_path / "xdg" / "phalanx" / "fashion-mnist"
    assert shm_kernel._cache_dir() == tmp_path / "xdg" / "phalanx" / "kernels"
    monkeypatch.setenv(fashion_mnist.CACHE_ENV_VAR, str(tmp_path / "data"))
    assert fashion_mnist.cache_dir_for(None) == tmp_path / "data"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert shm_kernel._cache_dir() == tmp_path / "home" / ".cache" / "phalanx" / "kernels"


def _no_home(monkeypatch, cwd) -> None:
    """A process with no $HOME and no password-database entry (a container's bare numeric user):
    os.path.expanduser("~") gives "~" back."""
    import pwd

    def no_entry(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    for name in ("HOME", "XDG_CACHE_HOME", fashion_mnist.CACHE_ENV_VAR):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    monkeypatch.chdir(cwd)


def test_no_home_falls_back_in_one_line_and_writes_nothing_where_the_run_starts(tmp_path, monkeypatch):
    # Before: a RuntimeError traceback ("Could not determine home directory"), and the kernels
    # cached in ./~/.cache/phalanx of the working directory.
    _no_home(monkeypatch, tmp_path)
    offline, logged = Offline(), []
    data = load_dataset(None, None, fetch=offline, log=logged.append)
    assert data.name == "digits" and offline.urls == []
    assert logged == ["fashion-mnist is not cached and there is no home to cache it in ($HOME is unset and uid "
                      f"{__import__('os').getuid()} has no entry in the password database), so no download was "
                      "tried; training on scikit-learn's digits instead (set PHALANX_DATA_DIR to a writable folder, "
                      "or pass --data-dir to use your own copy)"]
    with pytest.raises(UsageError, match=r"^cannot download Fashion-MNIST \(there is no home to cache it in "):
        load_dataset("fashion-mnist", None, fetch=offline, log=logged.append)
    assert list(tmp_path.iterdir()) == []
