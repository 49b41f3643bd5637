"""The `phalanx` command end to end, and its bad-input contract: one line, exit 2, nothing written;
and in a fresh interpreter, `phalanx --help` lists every command without loading torch (each
command's module is imported only when it is named), and `--version` prints the version."""

import subprocess
import sys

import pytest

import phalanx
from phalanx.cli import COMMANDS, main

pytestmark = pytest.mark.distributed


def _run_cli(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "phalanx", *args], capture_output=True, text=True, timeout=timeout)


def test_train_two_devices_end_to_end(tmp_path, idx_dir):
    out = tmp_path / "run"
    proc = _run_cli("train", "--devices", "cpu:2", "--data-dir", str(idx_dir), "--epochs", "1",
                    "--allreduce", "ring", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("test acc: ") and lines[-1].endswith("sec/epoch on [cpu:0, cpu:1]"), lines
    seconds = lines[-1].split(", ")[1].split()[0]  # a short epoch keeps two decimals: 0.27, not 0.3
    assert len(seconds.split(".")[1]) == (2 if float(seconds) < 1 else 1), lines[-1]
    assert sum(line.startswith("epoch ") for line in lines) == 1  # rank 0 alone reports
    for name in ("metrics.jsonl", "accuracy.png", "model.pt"):
        assert (out / name).stat().st_size > 0
    assert (out / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp files left


def _bad(tmp_path, capsys, *args):
    out = tmp_path / "out"
    code = main(["train", *args, "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert err.startswith("phalanx: error: ")
    assert "Traceback" not in err
    assert not out.exists(), "a refused run must not leave output behind"
    return err


def test_bad_numbers(tmp_path, capsys):
    assert "--epochs 0" in _bad(tmp_path, capsys, "--epochs", "0", "--dataset", "synthetic")
    assert "--lr -0.1" in _bad(tmp_path, capsys, "--lr", "-0.1", "--dataset", "synthetic")
    assert "--lr 0.0" in _bad(tmp_path, capsys, "--lr", "0", "--dataset", "synthetic")
    assert "smaller than the 4 devices" in _bad(tmp_path, capsys, "--devices", "cpu:4", "--batch-size", "3")
    assert "invalid int value" in _bad(tmp_path, capsys, "--epochs", "ten")
    assert "cuda:0,1" in _bad(tmp_path, capsys, "--devices", "cuda:0,1")  # no GPU here


def test_bad_data(tmp_path, capsys, idx_dir):
    import shutil

    err = _bad(tmp_path, capsys, "--data-dir", str(tmp_path / "nope"), "--devices", "cpu:2")
    assert "nope" in err
    broken = tmp_path / "broken"
    shutil.copytree(idx_dir, broken)
    (broken / "t10k-labels-idx1-ubyte.gz").unlink()
    assert "t10k-labels" in _bad(tmp_path, capsys, "--data-dir", str(broken), "--devices", "cpu:2")
    truncated = tmp_path / "truncated"
    shutil.copytree(idx_dir, truncated)
    raw = (truncated / "train-images-idx3-ubyte.gz").read_bytes()
    (truncated / "train-images-idx3-ubyte.gz").write_bytes(raw[: len(raw) // 2])
    _bad(tmp_path, capsys, "--data-dir", str(truncated))
    magic = tmp_path / "magic"
    shutil.copytree(idx_dir, magic)
    import gzip

    data = bytearray(gzip.decompress((magic / "t10k-images-idx3-ubyte.gz").read_bytes()))
    data[2] = 0x42  # not a known IDX dtype
    (magic / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(bytes(data)))
    _bad(tmp_path, capsys, "--data-dir", str(magic), "--devices", "cpu:2")


def test_usage_error_exits_2_in_a_real_process(tmp_path):
    proc = _run_cli("train", "--lr", "-1", "--out", str(tmp_path / "o"))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


def _phalanx(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "phalanx", *argv], capture_output=True,
                          text=True, timeout=120)


def test_the_top_level_help_lists_every_command_and_imports_no_torch():
    done = _phalanx("--help")
    assert done.returncode == 0, done.stderr
    for name, command in COMMANDS.items():
        assert name in done.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time")]
    assert "phalanx.cli" in imported and not [m for m in imported if m.split(".")[0] == "torch"], imported
    assert "torch" not in done.stdout + done.stderr  # what `... --help 2>&1 | grep -c torch` counts: 0


def test_version_in_a_fresh_interpreter_prints_the_version_and_exits_0():
    done = _phalanx("--version")
    assert (done.returncode, done.stdout) == (0, f"phalanx {phalanx.__version__}\n")
