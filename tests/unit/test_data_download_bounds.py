"""What a download may cost a run: nothing where the cache cannot be written (no attempt, one
line, the fallback), at most one deadline for all attempts of a call, and a few seconds for a
silent server or proxy; and a relative $XDG_CACHE_HOME is ignored, as the XDG spec says."""

from __future__ import annotations

import socket
import time
import urllib.error
from pathlib import Path

import pytest

from phalanx.data import fashion_mnist, load_dataset
from phalanx.errors import UsageError

# A virtual filesystem: no directory can be made there, whatever the mode bits (or root) say.
UNWRITABLE = Path("/proc/phalanx-no-cache/fashion-mnist")


class Counting:
    """A network that fails every URL, after `delay_s`; counts the attempts."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.urls: list[str] = []
        self.delay_s = delay_s

    def __call__(self, url: str) -> bytes:
        self.urls.append(url)
        time.sleep(self.delay_s)
        raise urllib.error.URLError("timed out")


def test_an_unwritable_cache_is_not_downloaded_into_and_says_so_in_one_line():
    network, logged = Counting(), []
    data = load_dataset(None, None, cache_dir=UNWRITABLE, fetch=network, log=logged.append)
    assert data.name == "digits" and network.urls == []  # nothing could be kept: nothing fetched
    assert len(logged) == 1
    assert logged[0].startswith(f"fashion-mnist is not cached and its cache {UNWRITABLE} cannot be written (")
    assert "so no download was tried; training on scikit-learn's digits instead (set PHALANX_DATA_DIR" in logged[0]


def test_an_unwritable_cache_named_by_dataset_is_one_line_naming_the_fix():
    network = Counting()
    with pytest.raises(UsageError, match=r"cannot be written .*; set PHALANX_DATA_DIR to a writable folder or "
                                         r"pass --data-dir DIR"):
        load_dataset("fashion-mnist", None, cache_dir=UNWRITABLE, fetch=network, log=lambda _: None)
    assert network.urls == []


def test_every_attempt_of_a_download_shares_one_deadline(tmp_path, monkeypatch):
    monkeypatch.setattr(fashion_mnist, "DOWNLOAD_DEADLINE_S", 0.5, raising=False)
    network = Counting(delay_s=0.3)
    began = time.monotonic()
    with pytest.raises(fashion_mnist.FashionMnistUnavailable, match="within the 0.5 s the download may take"):
        fashion_mnist.ensure_cached(tmp_path / "cache", fetch=network, mirrors=[f"http://m{i}/" for i in range(8)],
                                    log=lambda _: None)
    assert len(network.urls) in (1, 2) and time.monotonic() - began < 2.0  # 8 mirrors x 0.3 s = 2.4 s before


@pytest.fixture
def silent_server():
    """A port that accepts connections (the kernel's backlog) and never answers: a dead proxy."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/train-images-idx3-ubyte.gz"


def test_a_silent_server_fails_an_attempt_after_the_stall_timeout(silent_server, monkeypatch):
    monkeypatch.setattr(fashion_mnist, "STALL_TIMEOUT_S", 0.3, raising=False)
    began = time.monotonic()
    with pytest.raises(OSError):
        fashion_mnist.fetch_url(silent_server)
    assert time.monotonic() - began < 3  # 30 s before
    began = time.monotonic()
    monkeypatch.setattr(fashion_mnist, "STALL_TIMEOUT_S", 30.0)
    with pytest.raises(OSError):  # the deadline shortens the stall timeout too
        fashion_mnist.fetch_url(silent_server, deadline=time.monotonic() + 0.3)
    assert time.monotonic() - began < 3


def test_a_relative_xdg_cache_home_is_ignored(tmp_path, monkeypatch):
    monkeypatch.delenv(fashion_mnist.CACHE_ENV_VAR, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert fashion_mnist.cache_dir_for(None) == tmp_path / "home" / ".cache" / "phalanx" / "fashion-mnist"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # an absolute one is followed
    assert fashion_mnist.cache_dir_for(None) == tmp_path / "xdg" / "phalanx" / "fashion-mnist"
