"""Paths and writes a run cannot use end in one line: a name over the
filesystem's limit or a path over PATH_MAX in --out, --checkpoint-dir, --trace or --data-dir is
bad input (exit 2, nothing created), an output write that fails is `WriteFailed` naming the file
(no temporary file left), and oversubscribed threads are named with the number that fits."""

from __future__ import annotations

import errno
import os

import pytest

from phalanx import atomic
from phalanx.runtime.binding import oversubscription
from phalanx.cli import main
from phalanx.data import load_dataset
from phalanx.errors import RunFailed, UsageError, WriteFailed
from phalanx.outdir import check_out_dir, check_out_file

LONG_NAME = "n" * 300  # over the 255 bytes of a name on ext4, xfs, btrfs, tmpfs
LONG_PATH = "/".join(["d" * 50] * 100)  # 5,099 characters of short names: over PATH_MAX (4096)


def _one_line(capsys, argv) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("phalanx: error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("flag", ["--out", "--checkpoint-dir", "--trace", "--data-dir"])
@pytest.mark.parametrize("kind", ["name", "path"])
def test_a_path_the_system_cannot_name_is_one_line(tmp_path, capsys, flag, kind):
    # Left to the OS, this is a traceback of OSError: [Errno 36] File name too long, and exit 1.
    target = tmp_path / (LONG_NAME if kind == "name" else LONG_PATH)
    dataset = [] if flag == "--data-dir" else ["--dataset", "synthetic"]  # only fashion-mnist reads --data-dir
    argv = ["train", *dataset, "--epochs", "1", "--no-progress", flag, str(target)]
    if flag != "--out":
        argv += ["--out", str(tmp_path / "out")]
    err = _one_line(capsys, argv)
    assert err.startswith(f"phalanx: error: {flag} ")
    if kind == "name":
        assert "has a name of 300 bytes, longer than the 255 bytes this filesystem allows; use a shorter name" in err
    else:
        assert "bytes a path may have here; use a shorter path" in err
    assert list(tmp_path.iterdir()) == []  # nothing created, --out included


def test_the_data_dir_check_holds_where_the_data_is_read(tmp_path):
    with pytest.raises(UsageError, match="--data-dir .* has a name of 300 bytes"):
        load_dataset("fashion-mnist", str(tmp_path / LONG_NAME))


def test_a_file_flag_is_checked_the_one_way_every_command_shares(tmp_path):
    # phalanx verify --out FILE: outdir.check_out_file, beside check_out_dir for directory flags.
    check_out_file(None)
    check_out_file(tmp_path / "report.json")
    for path, words in [(tmp_path, "is a directory; name a file, e.g. --out "),
                        (tmp_path / "no" / "r.json", "directory .*no does not exist; create it"),
                        ("/proc/phalanx-12.json", "cannot be written .* pick a path on a writable filesystem"),
                        (tmp_path / LONG_NAME, "has a name of 300 bytes")]:
        with pytest.raises(UsageError, match=words):
            check_out_file(path, flag="--out")
    assert list(tmp_path.iterdir()) == []  # the probes left nothing


def test_a_failed_write_names_the_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    def disk_full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomic.os, "fsync", disk_full)
    target = tmp_path / "model.pt"
    with pytest.raises(WriteFailed) as failure:
        atomic.atomic_write_bytes(target, b"weights")
    assert str(failure.value) == (f"cannot write {target} (No space left on device); free space there or choose "
                                  "another directory")
    assert isinstance(failure.value, RunFailed) and isinstance(failure.value, OSError)  # exit 1; OSError handlers
    assert failure.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


def test_a_directory_that_vanished_is_named_too(tmp_path):
    # An --out deleted mid-run was told to "free space there".
    with pytest.raises(WriteFailed, match=r"cannot write .*gone/metrics.jsonl \(No such file or directory\); its "
                                          r"directory was removed while the run wrote there; choose a directory"):
        atomic.atomic_write_bytes(tmp_path / "gone" / "metrics.jsonl", b"{}")


def test_a_file_size_limit_is_named_with_its_fix(tmp_path, monkeypatch):
    def too_large(fd):  # what a write past `ulimit -f` meets (Python ignores SIGXFSZ)
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))

    monkeypatch.setattr(atomic.os, "fsync", too_large)
    with pytest.raises(WriteFailed, match=r"\(File too large\); the file is larger than this process may write "
                                          r"\(ulimit -f, .*\); raise the limit \(ulimit -f unlimited\)"):
        atomic.atomic_write_bytes(tmp_path / "checkpoint.pt", b"weights")
    assert list(tmp_path.iterdir()) == []


def test_oversubscription_is_named_with_the_count_that_fits():
    assert oversubscription(1, 2, cores=2) is None
    assert oversubscription(2, 1, cores=2) is None
    assert oversubscription(1, 8, cores=2) is None  # 8 devices on 2 cores: one thread each is all one can do
    assert oversubscription(64, 2, cores=2) == (
        "--threads-per-device 64 x 2 local worker(s) = 128 threads on 2 cores: they take turns and training can be "
        "many times slower; use --threads-per-device 1, or leave it unset (cores / workers)")
    assert "use --threads-per-device 4," in oversubscription(5, 2, cores=8)


def _links(tmp_path):
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    return {"dangling": f"a symlink to {tmp_path / 'nowhere'}, which does not exist", "loop": "a loop of symlinks"}


@pytest.mark.parametrize("flag", ["--out", "--checkpoint-dir", "--trace"])
@pytest.mark.parametrize("link", ["dangling", "loop"])
@pytest.mark.parametrize("below", [False, True])
def test_a_symlink_leading_nowhere_is_one_line_before_training(tmp_path, capsys, flag, link, below):
    # Left to the directory lock, this is a 23-line traceback ending FileExistsError (--trace after training).
    what = _links(tmp_path)[link]
    target = tmp_path / link / "run" if below else tmp_path / link
    dataset = [] if flag == "--data-dir" else ["--dataset", "synthetic"]  # only fashion-mnist reads --data-dir
    argv = ["train", *dataset, "--epochs", "1", "--no-progress", flag, str(target)]
    argv += ["--checkpoint-every", "5"] if flag == "--checkpoint-dir" else []
    err = _one_line(capsys, argv)
    where = f" cannot be created: {tmp_path / link}" if below else ""
    assert err == (f"phalanx: error: {flag} {target}{where} is {what}; point the link at a directory, remove it, "
                   "or pick another directory")
    assert "epoch" not in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "loop"]  # nothing created


def test_a_dangling_default_checkpoint_dir_is_one_line(tmp_path, capsys):
    what = _links(tmp_path)["dangling"]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "checkpoints").symlink_to(tmp_path / "nowhere")
    err = _one_line(capsys, ["train", "--dataset", "synthetic", "--epochs", "1", "--no-progress",
                             "--out", str(tmp_path / "out"), "--checkpoint-every", "5"])
    assert err.startswith(f"phalanx: error: the checkpoint dir {tmp_path / 'out' / 'checkpoints'} is {what}; ")


@pytest.mark.parametrize("flag", ["--out", "--checkpoint-dir", "--trace"])
def test_an_empty_output_path_is_refused(tmp_path, capsys, monkeypatch, flag):
    # Taken as is, --out "" trains and writes nothing (with --checkpoint-every, checkpoints go to /checkpoints).
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--dataset", "synthetic", "--epochs", "1", "--no-progress", flag, ""]
    argv += ["--checkpoint-every", "5"] if flag == "--checkpoint-dir" else []
    assert _one_line(capsys, argv) == f"phalanx: error: {flag} is empty; name a directory, or drop {flag}"
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_working_directory_is_named_by_its_absolute_path(tmp_path, monkeypatch):
    # Before: "--out runs/r1 is not writable (. denies writing)", from a cwd the user may not know.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as a read-only cwd says (root passes it)
    with pytest.raises(UsageError) as info:
        check_out_dir("runs/r1")
    assert str(info.value) == f"--out runs/r1 is not writable ({tmp_path} denies writing); pick another directory"


def _one_rank_run():
    """A world of one, a model and its optimizer: what phalanx.checkpoint and resume take."""
    import torch

    from phalanx.runtime.world import World

    world = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), backend="none",
                  timeout_s=5.0)
    model = torch.nn.Linear(2, 2)
    return world, model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_location_an_api_call_names_under_a_file_is_one_line_and_makes_nothing(tmp_path):
    # phalanx.checkpoint and MetricsLogger made their directory with mkdir: a file on the way was
    # FileExistsError's or NotADirectoryError's traceback (the CLI's flags were checked before).
    import phalanx
    from phalanx.atomic import make_dir

    world, model, optimizer = _one_rank_run()
    blocker = tmp_path / "afile"
    blocker.write_text("")
    for location in (blocker / "ck.pt", blocker / "deeper" / "ck.pt"):
        with pytest.raises(UsageError) as caught:
            phalanx.checkpoint(location, world=world, model=model, optimizer=optimizer, epoch=0, global_batch_size=4,
                               seed=0)
        line = str(caught.value)
        assert "\n" not in line and line.startswith("phalanx.checkpoint's location "), line
        assert line.endswith(f"cannot be created ({blocker} is a file); pick another directory"), line
    with pytest.raises(UsageError, match=r"^MetricsLogger's out_dir .*afile/logs cannot be created \(.*afile is a "
                                         r"file\); pick another directory$"):
        phalanx.MetricsLogger(blocker / "logs", world=world)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"] and blocker.read_text() == ""
    make_dir(tmp_path / "a" / "b", named="x")  # what can be made is made, and an existing one is fine
    make_dir(tmp_path / "a" / "b", named="x")
    assert (tmp_path / "a" / "b").is_dir()


def test_an_empty_checkpoint_location_is_refused_not_the_working_directory(tmp_path, monkeypatch):
    # `phalanx.checkpoint(os.environ.get("CKPT", ""), ...)` wrote ./checkpoint.pt, as Path("") is ".".
    import phalanx

    world, model, optimizer = _one_rank_run()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"^phalanx.checkpoint's location is empty; name a directory"):
        phalanx.checkpoint("", world=world, model=model, optimizer=optimizer, epoch=0, global_batch_size=4, seed=0)
    with pytest.raises(UsageError, match=r"^phalanx.resume's location is a NoneType; pass a directory"):
        phalanx.resume(location=None, world=world, model=model, optimizer=optimizer, global_batch_size=4, seed=0)
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_without_its_optimizer_is_refused_naming_how_to_keep_the_weights(tmp_path):
    # phalanx.checkpoint(..., optimizer=None), to keep a model's weights, met an AttributeError inside the save
    # ("'NoneType' object has no attribute 'param_groups'").
    import phalanx

    world, model, _ = _one_rank_run()
    for call in (phalanx.checkpoint, phalanx.resume):
        extra = {"epoch": 0} if call is phalanx.checkpoint else {}
        with pytest.raises(UsageError, match=rf"^phalanx.{call.__name__} needs optimizer=, the optimizer the loop steps "
                                             r"\(its state is what makes the resume exact\), got NoneType; to keep the "
                                             r"weights alone, torch.save\(dp.state_dict\(\), path\) on rank 0"):
            call(tmp_path / "ck", world=world, model=model, optimizer=None, global_batch_size=4, seed=0, **extra)
    assert list(tmp_path.iterdir()) == []
