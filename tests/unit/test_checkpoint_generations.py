"""Checkpoints kept two deep and read back only whole: a save keeps the checkpoint it
replaces as checkpoint.previous.pt; a byte flipped inside a tensor record - which torch.load
itself loads without a word - is refused in one line naming the file and the record; a
directory's damaged newest checkpoint gives way to the one before it, saying so, and is set aside
(checkpoint.damaged.pt), so no later save rotates it over the intact one; a save that fails (a
full disk, simulated by an fsync that raises ENOSPC) rotates nothing; a file named on its own is
refused, naming the one before it. (The listings name this process's hold on the checkpoint too,
.checkpoint.pt.lock: file_lock.py, released as the process ends.)"""

import errno
import os
import warnings

import pytest
import torch

from phalanx.cli import main
from phalanx.data.config import DataConfig
from phalanx.errors import PhalanxWarning, UsageError, WriteFailed
from phalanx.models import build_model
from phalanx.train import checkpoint as ckpt
from phalanx.train import checkpoint_files, script_checkpoint
from phalanx.runtime.world import World
from tests.distributed.runs import flip_record_byte

WORLD = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
              backend="none", timeout_s=10.0)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("lenet", init="pytorch", num_classes=10)


def _save(directory, model, epoch: int) -> None:
    script_checkpoint.checkpoint(directory, world=WORLD, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                    epoch=epoch, global_batch_size=256, seed=0)


def _resume(directory, model):
    return script_checkpoint.resume(directory, world=WORLD, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                       global_batch_size=256, seed=0)


def test_a_save_keeps_the_checkpoint_it_replaces(tmp_path):
    model = _model()
    for epoch in (1, 2, 3):
        _save(tmp_path, model, epoch)
    newest, previous = ckpt.generation_paths(tmp_path)
    assert (newest.name, previous.name) == ("checkpoint.pt", "checkpoint.previous.pt")
    assert ckpt.read_checkpoint(newest)["epoch"] == 3 and ckpt.read_checkpoint(previous)["epoch"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [".checkpoint.pt.lock", "checkpoint.previous.pt", "checkpoint.pt"]


def test_without_hard_links_the_previous_one_is_copied(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(checkpoint_files.os, "link", no_links)
    model = _model()
    _save(tmp_path, model, 1)
    _save(tmp_path, model, 2)
    assert [ckpt.read_checkpoint(p)["epoch"] for p in ckpt.generation_paths(tmp_path)] == [2, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".checkpoint.pt.lock", "checkpoint.previous.pt", "checkpoint.pt"]


def test_a_flipped_byte_in_a_tensor_is_refused_in_one_line_naming_the_file(tmp_path):
    _save(tmp_path, _model(), 1)
    path = tmp_path / "checkpoint.pt"
    record = flip_record_byte(path)
    torch.load(path, weights_only=True)  # the defect: torch.load itself takes the damaged file
    with pytest.raises(UsageError) as info:
        ckpt.read_checkpoint(tmp_path)
    assert str(info.value) == (f"checkpoint {path} is damaged: its record {record} fails its CRC-32 check (the "
                               "bytes changed after they were written); resume from another one")
    with pytest.raises(UsageError, match="is damaged: its record"):  # with no generation before it
        _resume(tmp_path, _model())


def test_a_damaged_newest_checkpoint_gives_way_to_the_one_before_it(tmp_path):
    model = _model()
    _save(tmp_path, model, 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    _save(tmp_path, model, 2)
    record = flip_record_byte(tmp_path / "checkpoint.pt")
    path, state, note = ckpt.read_newest(tmp_path)
    assert (path.name, state["epoch"]) == ("checkpoint.previous.pt", 1)
    assert note == (f"{tmp_path / 'checkpoint.pt'} is damaged: its record {record} fails its CRC-32 check (the bytes "
                    "changed after they were written), so this is the checkpoint before it")
    fresh = _model()
    with pytest.warns(PhalanxWarning, match=r"resuming from \S+checkpoint.previous.pt: \S+checkpoint.pt is damaged") as said:
        position = _resume(tmp_path, fresh)
    assert [w.filename for w in said if w.category is PhalanxWarning] == [__file__]  # the caller's line, not phalanx's
    assert position.epoch == 1
    for a, b in zip(_model().state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)  # epoch 1's weights, not the damaged epoch 2's


def test_a_file_named_on_its_own_is_refused_naming_the_one_before_it(tmp_path):
    model = _model()
    _save(tmp_path, model, 1)
    _save(tmp_path, model, 2)
    flip_record_byte(tmp_path / "checkpoint.pt")
    with pytest.raises(UsageError) as info:
        ckpt.read_newest(tmp_path / "checkpoint.pt")
    message = str(info.value)
    assert message.startswith(f"checkpoint {tmp_path / 'checkpoint.pt'} is damaged: its record ")
    assert message.endswith(f"; resume from {tmp_path / 'checkpoint.previous.pt'}, the checkpoint before it")


def test_both_generations_damaged_is_one_line_naming_both(tmp_path):
    model = _model()
    _save(tmp_path, model, 1)
    _save(tmp_path, model, 2)
    for path in ckpt.generation_paths(tmp_path):
        flip_record_byte(path)
    with pytest.raises(UsageError) as info:
        ckpt.read_newest(tmp_path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"checkpoint {tmp_path / 'checkpoint.pt'} is damaged")
    assert f"and so is the one before it, {tmp_path / 'checkpoint.previous.pt'}; resume from a copy" in message


def test_a_missing_newest_checkpoint_gives_way_too(tmp_path):
    model = _model()
    _save(tmp_path, model, 1)
    _save(tmp_path, model, 2)
    os.unlink(tmp_path / "checkpoint.pt")
    assert ckpt.has_checkpoint(tmp_path)
    path, state, note = ckpt.read_newest(tmp_path)
    assert (path.name, state["epoch"]) == ("checkpoint.previous.pt", 1) and note.endswith("checkpoint.pt is missing, "
                                                                                          "so this is the checkpoint "
                                                                                          "before it")


@pytest.mark.skipif(not hasattr(torch.serialization, "set_crc32_options"),
                    reason="this torch (before 2.6) always writes the CRCs: nothing to turn off")
def test_crcs_are_written_even_where_the_process_turned_them_off(tmp_path):
    torch.serialization.set_crc32_options(False)
    try:
        _save(tmp_path, _model(), 1)
        assert not torch.serialization.get_crc32_options()  # the process's choice is left as it was
    finally:
        torch.serialization.set_crc32_options(True)
    assert ckpt.read_checkpoint(tmp_path)["epoch"] == 1


def test_the_command_refuses_a_damaged_checkpoint_before_training(tmp_path, capsys):
    _save(tmp_path / "ck", _model(), 1)
    flip_record_byte(tmp_path / "ck" / "checkpoint.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        code = main(["train", "--dataset", "synthetic", "--devices", "1", "--no-progress", "--epochs", "2",
                     "--resume", str(tmp_path / "ck")])
    captured = capsys.readouterr()
    assert code == 2, captured
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"phalanx: error: checkpoint {tmp_path / 'ck' / 'checkpoint.pt'} "
                                                   "is damaged: its record "), captured.err
    assert "epoch" not in captured.out  # nothing trained


def test_a_checkpoint_no_worker_could_read_is_refused_before_the_workers_start(tmp_path, capsys, monkeypatch):
    """--resume naming a damaged or missing checkpoint: the launcher's one line, before it reads the
    data or starts a worker (it used to start both, and rank 0 said the same line 3 s later)."""
    from phalanx.job import command

    def never(*args, **kwargs):
        raise AssertionError("the run went on past a checkpoint no worker could read")
    monkeypatch.setattr(command, "train_with_restarts", never)
    monkeypatch.setattr(DataConfig, "load", never)
    _save(tmp_path / "ck", _model(), 1)
    flip_record_byte(tmp_path / "ck" / "checkpoint.pt")
    train = ["train", "--dataset", "synthetic", "--devices", "cpu:2", "--no-progress", "--out", str(tmp_path / "run")]
    for resume, said in ((tmp_path / "ck" / "checkpoint.pt", "is damaged: its record "),
                         (tmp_path / "none", "no checkpoint at ")):
        code = main([*train, "--resume", str(resume)])
        err = capsys.readouterr().err
        assert code == 2 and len(err.splitlines()) == 1 and said in err, err
    assert not (tmp_path / "run").exists()  # nothing made on disk
    # A directory whose newest file is damaged resumes from the one before it: not refused here.
    _save(tmp_path / "two", _model(), 1)
    _save(tmp_path / "two", _model(), 2)
    flip_record_byte(tmp_path / "two" / "checkpoint.pt")
    with pytest.raises(AssertionError, match="the run went on"):
        main([*train, "--resume", str(tmp_path / "two")])


def _full_disk(monkeypatch, directory) -> None:
    """Every write into `directory` fails as a full disk does: at the fsync of its bytes."""
    real = os.fsync

    def fsync(fd):
        if os.path.dirname(os.readlink(f"/proc/self/fd/{fd}")) == str(directory):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def _epochs(directory) -> list[int]:
    return [ckpt.read_checkpoint(p)["epoch"] for p in ckpt.generation_paths(directory)]


def test_a_save_that_fails_rotates_nothing(tmp_path, monkeypatch):
    model = _model()
    _save(tmp_path, model, 1)
    _save(tmp_path, model, 2)
    _full_disk(monkeypatch, tmp_path)
    with pytest.raises(WriteFailed, match="No space left on device"):
        _save(tmp_path, model, 3)
    assert _epochs(tmp_path) == [2, 1]  # both generations as they were, nothing half-written beside them
    assert sorted(p.name for p in tmp_path.iterdir()) == [".checkpoint.pt.lock", "checkpoint.previous.pt", "checkpoint.pt"]


def test_after_a_fall_back_the_damaged_file_is_no_generation_and_a_failed_save_keeps_the_good_one(tmp_path,
                                                                                                   monkeypatch):
    model = _model()
    _save(tmp_path, model, 1)
    _save(tmp_path, model, 2)
    flip_record_byte(tmp_path / "checkpoint.pt")
    with pytest.warns(PhalanxWarning, match=r"so this is the checkpoint before it \(kept as checkpoint.damaged.pt, "
                                            r"no longer a checkpoint\)"):
        assert _resume(tmp_path, _model()).epoch == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [".checkpoint.pt.lock", "checkpoint.damaged.pt", "checkpoint.previous.pt"]
    with monkeypatch.context() as patched:
        _full_disk(patched, tmp_path)
        with pytest.raises(WriteFailed):  # the resumed run's first save fails
            _save(tmp_path, model, 3)
    with pytest.warns(PhalanxWarning, match="checkpoint.pt is missing, so this is the checkpoint before it"):
        assert _resume(tmp_path, _model()).epoch == 1  # the good generation is still there
    _save(tmp_path, model, 3)
    assert _epochs(tmp_path) == [3, 1]  # the damaged file never became the generation before the new one


def test_a_resume_that_needs_no_fall_back_sets_nothing_aside(tmp_path):
    model = _model()
    _save(tmp_path, model, 1)
    _save(tmp_path, model, 2)
    os.unlink(tmp_path / "checkpoint.pt")  # missing, not damaged: nothing to set aside
    with pytest.warns(PhalanxWarning, match="is missing, so this is the checkpoint before it$"):
        _resume(tmp_path, _model())
    assert _resume(tmp_path / "checkpoint.previous.pt", _model()).epoch == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [".checkpoint.previous.pt.lock", ".checkpoint.pt.lock",
                                                          "checkpoint.previous.pt"]  # a file named on its own is held
