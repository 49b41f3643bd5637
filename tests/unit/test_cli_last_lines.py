"""Errors no part of phalanx raised as its own still end the CLI in one line where they have a known cause.

Under torchrun, a worker whose collective lost its peer ends in one line, not gloo's traceback.

With one worker per host `auto` exchanges through gloo (native): a host that died left the other
worker a ~100-line traceback ending in gloo's "Read error ... Connection reset by peer ...
GLHF!" (found by an outside operator's trial). phalanx's own launcher names the failed rank;
under torchrun each worker says its side in one line. Other errors, and the same error outside
torchrun, are left as they are. A launcher out of file descriptors (`ulimit -n 20`) said
`OSError: [Errno 24] Too many open files` under a traceback from multiprocessing; now the limit
and how to raise it.
"""

from __future__ import annotations

import errno

import pytest

from phalanx import cli

GLOO = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:12170: Connection reset by peer. "
        "This is typically caused by a peer exiting. GLHF!")
TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0"}


def _main_raising(monkeypatch, exc: BaseException, env: dict) -> int:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    def run(argv):
        raise exc

    monkeypatch.setattr(cli, "_run_command", run)
    return cli.main(["train"])


def test_a_lost_peer_under_torchrun_is_one_line(monkeypatch, capsys):
    assert _main_raising(monkeypatch, RuntimeError(GLOO), TORCHRUN) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("phalanx: run stopped: rank 0 (on "), err
    assert "lost its connection to another rank (Read error [127.0.0.1]:12170: Connection reset by peer): a worker" \
        in err


@pytest.mark.parametrize("exc, env", [(RuntimeError(GLOO), {}), (RuntimeError("shape mismatch"), TORCHRUN),
                                      (OSError("Connection reset by peer"), TORCHRUN)])
def test_other_errors_and_outside_torchrun_are_left_as_they_are(monkeypatch, exc, env):
    with pytest.raises(type(exc)):
        _main_raising(monkeypatch, exc, env)


def test_too_many_open_files_is_one_line_naming_the_limit(monkeypatch, capsys):
    assert _main_raising(monkeypatch, OSError(errno.EMFILE, "Too many open files"), {}) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("phalanx: run stopped: too many open files: this process may hold ")
    assert "(ulimit -n), and the workers, their pipes and the shared memory need more; raise it (ulimit -n 1024)" in err
