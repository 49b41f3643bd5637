"""The bad-input catalogue, each entry a `phalanx train` run that must be refused cleanly.

Every entry runs the real command in this process (`phalanx.cli.main`) and asserts the contract:
exit code 2, exactly one line on stderr, `phalanx: error: <problem>; <fix>` (the row's problem
pattern, then its fix pattern; the config's own messages put the fix as "must be at least 1"),
no traceback anywhere, and nothing written to `--out`. No entry starts
a worker process: each is refused before the launch (data with --devices 2 is checked in the
launching process) or inside the in-process worker of a 1-device run. The same contract in real
subprocesses (exit status, no traceback from the interpreter) is tests/distributed/test_bad_input_cli.py.
Damaged data is built in tmp_path from copies of the real Fashion-MNIST sample.
"""

from __future__ import annotations

import functools
import gzip
import http.server
import os
import re
import shutil
import struct
import threading
from pathlib import Path

import pytest

from phalanx.cli import main
from phalanx.data import fashion_mnist, read_idx, write_idx
from phalanx.data import idx as idx_module
from phalanx.runtime.devices import parse_devices
from phalanx.errors import UsageError

IMAGES, LABELS = "train-images-idx3-ubyte", "train-labels-idx1-ubyte"
PREFIX = "phalanx: error: "
REAL_FETCH = fashion_mnist.fetch_url  # before the autouse fixture below swaps in an offline one


def refuse(argv: list[str], out: Path, capsys) -> str:
    """Run `phalanx train ARGV --out OUT`; assert the bad-input contract; return the message."""
    code = main(["train", *argv, "--out", str(out), "--no-progress"])
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert code == 2, captured
    assert len(lines) == 1 and lines[0].startswith(PREFIX), captured.err
    assert "Traceback" not in captured.err + captured.out
    assert not out.exists(), "a refused run must not leave output behind"
    return lines[0][len(PREFIX) :]


def sample_copy(idx_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "data"
    shutil.copytree(idx_dir, copy)
    for path in copy.iterdir():
        path.chmod(0o644)  # the shared sample is read-only; its copy must be editable
    return copy


def rewrite(directory: Path, stem: str, edit, *, compressed: bool = True) -> None:
    """Replace `stem` in `directory` by edit(its decompressed IDX bytes), gzipped or raw."""
    data = edit(gzip.decompress((directory / f"{stem}.gz").read_bytes()))
    (directory / f"{stem}.gz").unlink()
    (directory / (f"{stem}.gz" if compressed else stem)).write_bytes(gzip.compress(data) if compressed else data)


def _set(position: int, value: bytes):
    return lambda data: data[:position] + value + data[position + len(value) :]


def _damage(damage):
    """A catalogue builder: a sample copy damaged by `damage(directory)`, read with --devices 2."""

    def build(idx_dir, tmp_path):
        directory = sample_copy(idx_dir, tmp_path)
        damage(directory)
        return ["--devices", "cpu:2", "--data-dir", str(directory)]

    return build


def _cut_gz(directory):
    raw = (directory / f"{IMAGES}.gz").read_bytes()
    (directory / f"{IMAGES}.gz").write_bytes(raw[: len(raw) // 2])


def _bad_crc(directory):
    raw = bytearray((directory / f"{LABELS}.gz").read_bytes())
    raw[-8] ^= 0xFF  # the CRC32 in the gzip trailer
    (directory / f"{LABELS}.gz").write_bytes(bytes(raw))


def _fewer_labels(directory):
    labels = read_idx(directory / f"{LABELS}.gz")
    write_idx(directory / f"{LABELS}.gz", labels[:-1], gzip=True)


def _no_training_images(directory: Path) -> None:
    """A well-formed pair of IDX files holding no examples at all (header only)."""
    rewrite(directory, IMAGES, lambda b: b[:4] + struct.pack(">I", 0) + b[8:16])
    rewrite(directory, LABELS, lambda b: b[:4] + struct.pack(">I", 0))


def _args(*argv):
    return lambda idx_dir, tmp_path: list(argv)


# (id, argv builder, problem pattern, fix pattern): the catalogue. README's table is this list.
CATALOGUE = [
    ("truncated-gz", _damage(_cut_gz),
     r"train-images-idx3-ubyte\.gz: truncated: the gzip stream ends before its end marker", r"; re-download it$"),
    ("truncated-raw", _damage(lambda d: rewrite(d, IMAGES, lambda b: b[: 16 + 1000 * 784], compressed=False)),
     r"train-images-idx3-ubyte: truncated: header says 3000x28x28 uint8 = 2352000 bytes, file has 784000 bytes",
     r"; re-download it$"),
    ("truncated-inside-gz", _damage(lambda d: rewrite(d, IMAGES, lambda b: b[:-784])),
     r"truncated: header says 3000x28x28 .* decompressed data has 2351216 bytes after the header", r"; re-download it$"),
    ("empty-file", _damage(lambda d: (d / "t10k-labels-idx1-ubyte.gz").write_bytes(b"")),
     r"t10k-labels-idx1-ubyte\.gz: empty file \(0 bytes\)", r"; re-download it$"),
    ("corrupt-gzip-crc", _damage(_bad_crc), r"train-labels-idx1-ubyte\.gz: corrupt gzip data \(CRC check failed",
     r"; re-download it$"),
    ("wrong-magic", _damage(lambda d: rewrite(d, IMAGES, _set(0, b"PK\x03\x04"))),
     r"not an IDX file \(starts with 50 4b 03 04, expected 00 00 <dtype> <ndim>\)",
     r"; point to the Fashion-MNIST IDX file, raw or \.gz$"),
    ("unknown-dtype-code", _damage(lambda d: rewrite(d, IMAGES, _set(2, b"\x42"))),
     r"unknown IDX dtype code 0x42", r"; the file is corrupt, re-download it$"),
    ("lying-header-10^12", _damage(lambda d: rewrite(d, IMAGES, _set(4, struct.pack(">I", 10**9)))),
     r"header says 1000000000x28x28 uint8 = 784000000000 bytes, over the \d+ byte limit", r"; .*re-download"),
    ("trailing-bytes", _damage(lambda d: rewrite(d, LABELS, lambda b: b + b"\x00")),
     r"trailing bytes after the 3000 uint8 = 3000 bytes", r"; .*re-download it$"),
    ("labels-not-images", _damage(_fewer_labels),
     r"has 2999 labels but train-images-idx3-ubyte\.gz has 3000 images",
     r"; the two files do not belong together, replace them with a matching pair$"),
    ("images-not-28x28", _damage(lambda d: rewrite(d, IMAGES, _set(8, struct.pack(">II", 784, 1)))),
     r"holds a 3000x784x1 uint8 array, not N x 28 x 28 uint8 images", r"; replace it with the Fashion-MNIST file"),
    ("label-out-of-range", _damage(lambda d: rewrite(d, LABELS, lambda b: b[:-1] + b"\x0c")),
     r"has label 12, outside Fashion-MNIST's 0\.\.9", r"; replace it with the Fashion-MNIST file"),
    ("empty-training-set", _damage(_no_training_images),
     r"train-images-idx3-ubyte\.gz holds 0 images; a training set needs at least one",
     r", replace it \(and its labels\) with a non-empty pair$"),
    ("missing-file", _damage(lambda d: (d / "t10k-images-idx3-ubyte.gz").unlink()),
     r"data dir .* has no t10k-images-idx3-ubyte\(\.gz\)",
     r"; put the four Fashion-MNIST files there or drop --data-dir to download them$"),
    ("missing-dir", lambda idx_dir, tmp_path: ["--data-dir", str(tmp_path / "nowhere")],
     r"data dir .*nowhere does not exist", r"; create it with the four Fashion-MNIST files or drop --data-dir"),
    ("data-dir-is-a-file", lambda idx_dir, tmp_path: ["--data-dir", str(idx_dir / f"{IMAGES}.gz")],
     r"data dir .* is not a directory", r"; pass the folder that holds the four Fashion-MNIST files"),
    ("batch-below-devices", _args("--devices", "cpu:4", "--batch-size", "3"),
     r"--batch-size 3 is smaller than the 4 devices", r"; use --batch-size 4 or more, or fewer devices$"),
    ("batch-zero", _args("--batch-size", "0"), r"--batch-size 0", r"must be at least 1$"),
    ("lr-zero", _args("--lr", "0"), r"--lr 0\.0", r"must be a positive finite number; use e\.g\. --lr 0\.2$"),
    ("lr-negative", _args("--lr", "-0.1"), r"--lr -0\.1", r"must be a positive finite number; use e\.g\. --lr 0\.2$"),
    ("lr-nan", _args("--lr", "nan"), r"--lr nan", r"must be a positive finite number; use e\.g\. --lr 0\.2$"),
    ("epochs-zero", _args("--epochs", "0"), r"--epochs 0", r"must be at least 1$"),
    ("epochs-negative", _args("--epochs", "-3"), r"--epochs -3", r"must be at least 1$"),
    ("epochs-not-a-number", _args("--epochs", "ten"), r"argument --epochs: invalid int value: 'ten'",
     r"\(see `phalanx train --help`\)$"),
    ("unknown-model", _args("--model", "vgg-nonexistent"), r"--model 'vgg-nonexistent' is unknown",
     r"; choose one of .*lenet"),
    ("unknown-dataset", _args("--dataset", "cifar"), r"--dataset 'cifar' is unknown",
     r"; choose one of fashion-mnist, digits, synthetic$"),
    ("unknown-allreduce", _args("--allreduce", "butterfly"), r"--allreduce 'butterfly' is unknown",
     r"; choose one of .*ring.*tree"),
    ("gpu-absent", _args("--devices", "cuda:0"), r"asks for GPU 0 but 0 GPUs are present",
     r"; use --devices cpu:1 to run 1 CPU worker instead$"),
    ("gpus-absent", _args("--devices", "cuda:0,1"), r"asks for GPU 0 but 0 GPUs are present",
     r"; use --devices cpu:2 to run 2 CPU workers instead$"),
    ("devices-zero", _args("--devices", "0"), r"--devices 0 asks for no device", r"; use --devices N, cpu:N"),
    ("devices-unknown-kind", _args("--devices", "tpu:2"), r"--devices 'tpu:2' is not understood",
     r"; use --devices N, cpu:N or cuda:0,1$"),
]


@pytest.fixture(autouse=True)
def _no_real_cache_or_gpu(tmp_path, monkeypatch):
    """No entry may touch the user's cache or network, and this test machine counts as GPU-less."""
    monkeypatch.setenv("PHALANX_DATA_DIR", str(tmp_path / "cache"))

    def offline(url, **kwargs):
        raise OSError(f"network disabled in tests ({url})")

    monkeypatch.setattr(fashion_mnist, "fetch_url", offline)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)


@pytest.mark.parametrize("build, problem, fix", [row[1:] for row in CATALOGUE], ids=[row[0] for row in CATALOGUE])
def test_catalogue(build, problem, fix, idx_dir, tmp_path, capsys):
    message = refuse(build(idx_dir, tmp_path), tmp_path / "out", capsys)
    assert re.search(problem, message), message
    assert re.search(fix, message[re.search(problem, message).end() :]), message


def test_catalogue_in_the_one_device_worker(idx_dir, tmp_path, capsys):
    # With one device the data is read inside the (in-process) worker, not by the launcher:
    # the same one line comes out.
    directory = sample_copy(idx_dir, tmp_path)
    rewrite(directory, IMAGES, _set(0, b"PK\x03\x04"))
    assert "not an IDX file" in refuse(["--data-dir", str(directory)], tmp_path / "out", capsys)


def test_unreadable_file(idx_dir, tmp_path, capsys):
    directory = sample_copy(idx_dir, tmp_path)
    (directory / f"{LABELS}.gz").chmod(0)
    if os.access(directory / f"{LABELS}.gz", os.R_OK):
        # root (CAP_DAC_OVERRIDE) reads it anyway, so phalanx must too (it judges by the read, not
        # by mode bits); the simulated case below checks the message a non-root user gets.
        from phalanx.data import load_dataset

        assert load_dataset("fashion-mnist", str(directory), download=False).num_train > 0
        return
    message = refuse(["--devices", "cpu:2", "--data-dir", str(directory)], tmp_path / "out", capsys)
    assert re.fullmatch(r".*train-labels-idx1-ubyte\.gz: permission denied; make it readable \(chmod a\+r\).*", message)


def test_unreadable_file_simulated(idx_dir, tmp_path, capsys, monkeypatch):
    # What the kernel answers a non-root user for a chmod 000 file, injected so it runs as root too.
    real_open = open

    def guarded_open(path, *args, **kwargs):
        if Path(path).name == f"{LABELS}.gz":
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(idx_module, "open", guarded_open, raising=False)
    message = refuse(["--devices", "cpu:2", "--data-dir", str(idx_dir)], tmp_path / "out", capsys)
    assert re.fullmatch(r".*train-labels-idx1-ubyte\.gz: permission denied; make it readable \(chmod a\+r\).*", message)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # the server must not write to the stderr under test
        pass


@pytest.fixture
def wrong_mirror(idx_dir, monkeypatch):
    """A local http.server serving the sample's files, which are not the official bytes, and a
    fetch_url that sends every mirror URL there: a download whose checksum cannot match."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler,
                                                                                   directory=str(idx_dir)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base, urls = f"http://127.0.0.1:{server.server_address[1]}/", []

    def fetch(url, **kwargs):
        urls.append(url)
        return REAL_FETCH(base + url.rsplit("/", 1)[-1], **kwargs)

    monkeypatch.setattr(fashion_mnist, "fetch_url", fetch)
    yield urls
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_checksum_mismatch_on_download(wrong_mirror, tmp_path, capsys):
    cache = tmp_path / "cache"
    message = refuse(["--dataset", "fashion-mnist", "--devices", "cpu:2"], tmp_path / "out", capsys)
    assert message.startswith("cannot download Fashion-MNIST (train-images-idx3-ubyte.gz: ")
    assert len(re.findall(r"MD5 [0-9a-f]{32} != official 8d4fb7e6c68d591d4c3dfef9ec88bf0d", message)) == 2
    assert message.endswith(f"; put the four official .gz files in {cache} or pass --data-dir DIR")
    assert [url.rsplit("/", 1)[-1] for url in wrong_mirror] == [f"{IMAGES}.gz"] * 2  # both mirrors tried
    assert not cache.exists()  # nothing unverified kept, not even an empty cache directory


def test_infinite_lr(tmp_path, capsys):
    # --data-dir points nowhere, so if --lr inf is (wrongly) accepted the run stops at the data instead.
    message = refuse(["--lr", "inf", "--data-dir", str(tmp_path / "nowhere")], tmp_path / "out", capsys)
    assert "--lr inf" in message


@pytest.mark.parametrize(
    "spec, cuda_count, message",
    [
        ("cuda:0", 0, "--devices 'cuda:0' asks for GPU 0 but 0 GPUs are present (torch sees no CUDA device); "
                      "use --devices cpu:1 to run 1 CPU worker instead"),
        ("cuda:0,3", 2, "--devices 'cuda:0,3' asks for GPU 3 but 2 GPUs are present (ids 0..1); "
                        "list present ids only, e.g. --devices cuda:0,1"),
        ("cuda:1", 1, "--devices 'cuda:1' asks for GPU 1 but 1 GPUs are present (ids 0); "
                      "list present ids only, e.g. --devices cuda:0"),
        ("3", 2, "--devices 3 asks for 3 GPUs but 2 are present; use --devices 2 or --devices cpu:3"),
    ],
)
def test_more_gpus_than_present(spec, cuda_count, message):
    with pytest.raises(UsageError) as info:
        parse_devices(spec, cuda_count=cuda_count)
    assert str(info.value) == message
