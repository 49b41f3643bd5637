"""The launcher's TCPStore on every torch pyproject accepts (>= 2.4): torch's libuv store takes
the launcher's listening socket only from 2.8 on; before, the launcher asks for the legacy store.
Found on torch 2.4.1, where every run of more than one worker failed at the store. A store that
fails shows its own error (the launcher closed the socket the store had closed: EBADF over it),
and a host whose loopback is down is one line before any store is made."""

import datetime
import errno
import os
import socket

import pytest
import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion

from phalanx.errors import UsageError
from phalanx.runtime import launch


def test_the_store_hosts_keys_a_client_reads():
    with launch.loopback_store(1, timeout_s=10) as port:
        client = dist.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=datetime.timedelta(seconds=10))
        client.set("k", "v")
        assert client.get("k") == b"v"


class _OldLibuv:
    """torch 2.4-2.7's store: libuv (the default) refuses a listening socket."""

    made: list[bool] = []

    def __init__(self, host, port, world_size, *, use_libuv=True, **kwargs):
        type(self).made.append(use_libuv)
        if use_libuv and "master_listen_fd" in kwargs:
            raise NotImplementedError("The libuv TCPStore backend does not support initialization with an listen fd")


@pytest.mark.parametrize("version, made", [("2.4.1", [False]), ("2.14.1", [True, False])])
def test_a_torch_whose_libuv_store_refuses_the_socket_gets_the_legacy_store(monkeypatch, version, made):
    monkeypatch.setattr(torch, "__version__", TorchVersion(version))
    monkeypatch.setattr(dist, "TCPStore", _OldLibuv)
    _OldLibuv.made = []
    with socket.socket() as sock:
        assert isinstance(launch._store_on(sock.fileno(), 0, 2, timeout_s=1), _OldLibuv)
    assert _OldLibuv.made == made  # 2.4: straight to the legacy one, with no error line from torch


class _FailingStore:
    """A store that takes the listening socket, closes it, and fails (as c10d's does when its own
    client cannot connect)."""

    def __init__(self, host, port, world_size, *, master_listen_fd, **kwargs):
        os.close(master_listen_fd)
        raise RuntimeError("the store's own error")


def test_a_store_that_fails_shows_its_own_error_not_ebadf(monkeypatch):
    monkeypatch.setattr(dist, "TCPStore", _FailingStore)
    with pytest.raises(RuntimeError, match="the store's own error"):
        with launch.loopback_store(2, timeout_s=1):
            pass


def test_a_loopback_that_is_down_is_one_line_naming_the_fix(monkeypatch):
    def unreachable(address, timeout=None):
        raise OSError(errno.ENETUNREACH, os.strerror(errno.ENETUNREACH))

    monkeypatch.setattr(socket, "create_connection", unreachable)
    monkeypatch.setattr(dist, "TCPStore", _FailingStore)  # never reached
    with pytest.raises(UsageError) as caught:
        with launch.loopback_store(2, timeout_s=1):
            pass
    message = str(caught.value)
    assert "cannot reach 127.0.0.1 (Network is unreachable)" in message and "ip link set lo up" in message
    assert "\n" not in message
