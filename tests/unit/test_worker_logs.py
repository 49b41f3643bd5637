"""torchrun's worker-log flags as phalanx run reads them (runtime/worker_logs.py), without processes:
the stream digits and per-rank maps, which streams each rank sends where, and the launcher's copy of
a tee'd file to the console (a thread reading files that grow). The runs themselves are
tests/distributed/test_worker_logs.py's."""

from __future__ import annotations

import pytest

from phalanx.runtime.worker_logs import WorkerLogs, _copied_to_console, parse_streams


@pytest.mark.parametrize("text, want", [("0", 0), ("3", 3), ("0:3,1:2", {0: 3, 1: 2}), (" 1 : 1 ", {1: 1})])
def test_torchruns_forms_are_read(text, want):
    assert parse_streams(text, flag="--tee") == want


@pytest.mark.parametrize("text", ["4", "x", "0:4", "a:1", ""])
def test_anything_else_is_one_line_naming_the_flag(text):
    with pytest.raises(ValueError, match=r"^--tee "):
        parse_streams(text, flag="--tee")


@pytest.mark.parametrize("options, rank, want", [
    ({}, 0, (0, 0)),  # no --log-dir: the console, as before
    ({"log_dir": "L"}, 1, (0, 3)),  # --log-dir alone tees both streams
    ({"log_dir": "L", "redirects": "3"}, 0, (3, 0)),
    ({"log_dir": "L", "redirects": "1", "tee": "2"}, 0, (1, 2)),
    ({"log_dir": "L", "redirects": "3", "tee": "3"}, 0, (3, 0)),  # a stream in both: to the files only
    ({"log_dir": "L", "tee": "0:3"}, 0, (0, 3)),
    ({"log_dir": "L", "tee": "0:3"}, 1, (0, 0)),  # a rank the map leaves out: the console alone
])
def test_which_streams_each_rank_sends_where(options, rank, want):
    assert WorkerLogs(**options).streams(rank) == want


def test_files_are_named_as_torchruns_attempts_and_ranks(tmp_path):
    logs = WorkerLogs(log_dir=str(tmp_path))
    assert logs.path(1, 3, 2) == tmp_path / "attempt_1" / "3" / "stderr.log"


def test_the_console_copy_prefixes_each_line_and_prints_an_unfinished_last_one_at_the_end(tmp_path, capsys):
    out, err = tmp_path / "stdout.log", tmp_path / "stderr.log"
    out.write_bytes(b"written before the copy began\n")
    err.write_bytes(b"")
    with _copied_to_console([(0, 1, out, out.stat().st_size), (1, 2, err, 0)]):
        with open(out, "ab") as handle:
            handle.write(b"step 1\nstep 2\nno newline")
        with open(err, "ab") as handle:
            handle.write(b"a warning\n")
    captured = capsys.readouterr()
    assert captured.out == "[rank 0]: step 1\n[rank 0]: step 2\n[rank 0]: no newline\n"
    assert captured.err == "[rank 1]: a warning\n"
