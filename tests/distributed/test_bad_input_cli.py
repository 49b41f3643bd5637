"""The bad-input contract in real processes: `python -m phalanx train ...` exits 2 with one line.

tests/unit/test_bad_input.py runs the whole catalogue in-process; these few entries run as a
user runs them, so the exit status is the interpreter's own and any traceback Python would print
(an exception escaping `main`, a warning, a crash at exit) shows up on stderr. One entry per path
the refusal takes: the launching process's data check (--devices 2), the 1-device in-process
worker, the device parser, and a download whose checksum fails (a local http.server); and
`phalanx run`: a missing script (exit 2), a refused phalanx call (exit 2, naming the script's
line), a script that raises on one rank or exits non-zero
(exit 1, the first line names the rank or the exit code).
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

TIMEOUT_S = 120


def run_refused(args: list[str], out: Path, *, env_cache: Path, python_c: str | None = None) -> str:
    """Run phalanx in a fresh interpreter; assert exit 2, one stderr line, no traceback, no --out."""
    env = {**os.environ, "PHALANX_DATA_DIR": str(env_cache), "CUDA_VISIBLE_DEVICES": ""}
    head = [sys.executable, "-c", python_c] if python_c else [sys.executable, "-m", "phalanx"]
    proc = subprocess.run([*head, "train", *args, "--out", str(out), "--no-progress"], capture_output=True,
                          text=True, timeout=TIMEOUT_S, env=env)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("phalanx: error: "), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not out.exists()
    return lines[0]


def _copy(idx_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "data"
    shutil.copytree(idx_dir, copy)
    for path in copy.iterdir():
        path.chmod(0o644)
    return copy


def test_truncated_download_launcher_checks(idx_dir, tmp_path):
    directory = _copy(idx_dir, tmp_path)
    raw = (directory / "train-images-idx3-ubyte.gz").read_bytes()
    (directory / "train-images-idx3-ubyte.gz").write_bytes(raw[: len(raw) // 2])
    line = run_refused(["--devices", "cpu:2", "--data-dir", str(directory)], tmp_path / "out", env_cache=tmp_path / "c")
    assert line.endswith("train-images-idx3-ubyte.gz: truncated: the gzip stream ends before its end marker; "
                         "re-download it")


def test_wrong_magic_one_device_worker(idx_dir, tmp_path):
    directory = _copy(idx_dir, tmp_path)
    (directory / "t10k-labels-idx1-ubyte.gz").write_bytes(b"PK\x03\x04 not an idx file")
    line = run_refused(["--data-dir", str(directory)], tmp_path / "out", env_cache=tmp_path / "c")
    assert "t10k-labels-idx1-ubyte.gz: not an IDX file (starts with 50 4b 03 04" in line


def test_gpu_that_is_not_there(tmp_path):
    line = run_refused(["--devices", "cuda:0"], tmp_path / "out", env_cache=tmp_path / "c")
    assert line == ("phalanx: error: --devices 'cuda:0' asks for GPU 0 but 0 GPUs are present (torch sees no CUDA "
                    "device); use --devices cpu:1 to run 1 CPU worker instead")


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


# Sends every mirror URL to the local server; the rest is the unchanged program.
_REDIRECTED = """
import sys
from phalanx.data import fashion_mnist
real_fetch = fashion_mnist.fetch_url
fashion_mnist.fetch_url = lambda url, **kw: real_fetch(BASE + url.rsplit('/', 1)[-1], **kw)
from phalanx.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


def test_checksum_mismatch_on_download(idx_dir, tmp_path):
    # The sample's files are real Fashion-MNIST but not the official files: their MD5s differ.
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler,
                                                                                   directory=str(idx_dir)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}/"
        cache = tmp_path / "cache"
        line = run_refused(["--dataset", "fashion-mnist"], tmp_path / "out", env_cache=cache,
                           python_c=_REDIRECTED.replace("BASE", repr(base)))
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert line.startswith("phalanx: error: cannot download Fashion-MNIST (train-images-idx3-ubyte.gz: ")
    assert line.count("!= official 8d4fb7e6c68d591d4c3dfef9ec88bf0d") == 2  # both mirrors, both refused
    assert line.endswith(f"; put the four official .gz files in {cache} or pass --data-dir DIR")
    assert not list(cache.glob("*.gz")) and not list(cache.glob(".*.tmp"))


def _phalanx_run(tmp_path: Path, body: str, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "user_script.py"
    script.write_text(body)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "phalanx", "run", *args, str(script)], capture_output=True,
                          text=True, timeout=TIMEOUT_S, env=env, cwd=tmp_path)


def test_run_refuses_a_missing_script_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", str(tmp_path / "nope.py")],
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("phalanx: error: script ") and "does not exist; name a Python file" in proc.stderr


def test_run_names_the_rank_whose_script_failed(tmp_path):
    """A user script's own error: exit 1, the first line names the rank and the error (its traceback follows)."""
    body = ("import phalanx\nworld = phalanx.init()\n"
            "if world.rank == 1:\n    raise ValueError('bad shard on purpose')\n"
            "phalanx.allreduce(__import__('torch').ones(1), world=world)\n")
    proc = _phalanx_run(tmp_path, body, "--devices", "cpu:2", "--timeout", "20", "--quiet")
    assert proc.returncode == 1, proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first == "phalanx: worker rank 1 failed: ValueError: bad shard on purpose", proc.stderr


def test_a_refused_call_in_a_script_is_named_by_its_file_and_line(tmp_path):
    """A phalanx call the script got wrong: exit 2, one line, led by the script's line that made it."""
    body = "import phalanx\n\nworld = phalanx.init(device='tpu')\n"
    proc = _phalanx_run(tmp_path, body, "--devices", "cpu:2", "--timeout", "20", "--quiet")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("phalanx: error: user_script.py:3: init(device='tpu') is not understood; use 'cpu' "
                                   "or 'cuda'"), proc.stderr


def test_run_reports_a_nonzero_sys_exit(tmp_path):
    proc = _phalanx_run(tmp_path, "import sys\nsys.exit(3)\n", "--devices", "cpu:2", "--quiet")
    assert proc.returncode == 1
    assert proc.stderr.strip() == "phalanx: run stopped: user_script.py exited with code 3 on rank 0", proc.stderr
