"""One job per checkpoint (file_lock.py): a held lock is refused in one line naming the holder's
pid, and taken once its holder lets go (as a dead holder does); one process holds it once; a
link in the lock file's place is refused without being written through; the lock file goes with
a normal exit, but only while it is still the holder's own. In one process: a second open file
description of the lock file plays the other process (a flock belongs to the open file, not the
process); tests/distributed/test_checkpoint_lock.py holds it in a real second job."""

import errno
import fcntl
import os

import pytest
import torch

from phalanx import file_lock
from phalanx.errors import UsageError, WriteFailed
from phalanx.file_lock import hold_for_process, lock_path, release_all
from phalanx.runtime.world import World
from phalanx.train import script_checkpoint


@pytest.fixture(autouse=True)
def _nothing_held_after():
    yield
    release_all()


def _refusal(holder: str) -> str:
    return f"held by {holder}"


def _other_holder(target, pid: str = "4242\n") -> int:
    """What another process's hold looks like: the lock file flocked through its own open file."""
    fd = os.open(lock_path(target), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.pwrite(fd, pid.encode(), 0)
    return fd


def test_a_held_lock_is_refused_naming_the_holder_and_taken_once_it_lets_go(tmp_path):
    target = tmp_path / "checkpoint.pt"
    other = _other_holder(target)
    with pytest.raises(UsageError, match=r"^held by pid 4242$"):
        hold_for_process(target, refusal=_refusal)
    os.close(other)  # as the kernel does for a holder that dies, SIGKILL included
    hold_for_process(target, refusal=_refusal)
    assert lock_path(target).read_text() == f"{os.getpid()}\n"


def test_one_process_holds_a_lock_once_and_its_exit_removes_the_file(tmp_path):
    target = tmp_path / "ck.pt"
    hold_for_process(target, refusal=_refusal)
    hold_for_process(tmp_path / "." / "ck.pt", refusal=_refusal)  # the same file, named otherwise: no second flock
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ck.pt.lock"]
    release_all()
    assert list(tmp_path.iterdir()) == []


def test_a_lock_file_a_killed_holder_left_is_reused(tmp_path):
    target = tmp_path / "ck.pt"
    lock_path(target).write_text("999999\n")  # nobody holds its flock
    hold_for_process(target, refusal=_refusal)
    assert lock_path(target).read_text() == f"{os.getpid()}\n"


def test_an_empty_lock_file_of_a_holder_names_no_pid(tmp_path, monkeypatch):
    monkeypatch.setattr(file_lock, "PID_WAIT_S", 0.1)
    target = tmp_path / "ck.pt"
    _other_holder(target, pid="")
    with pytest.raises(UsageError, match=r"^held by pid unknown$"):
        hold_for_process(target, refusal=_refusal)


def test_a_link_in_the_lock_files_place_is_refused_and_not_written_through(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    target = tmp_path / "ck.pt"
    lock_path(target).symlink_to(victim)
    with pytest.raises(UsageError, match=r"\.ck\.pt\.lock is not a regular file .*; remove it and start again$"):
        hold_for_process(target, refusal=_refusal)
    assert victim.read_text() == "keep me"
    os.mkfifo(tmp_path / ".fifo.pt.lock")  # a FIFO: refused at once, not waited on
    with pytest.raises(UsageError, match=r"\.fifo\.pt\.lock is not a regular file; remove it"):
        hold_for_process(tmp_path / "fifo.pt", refusal=_refusal)


def test_a_file_its_holder_removed_between_open_and_flock_is_not_taken(tmp_path, monkeypatch):
    target = tmp_path / "ck.pt"
    real_flock, calls = fcntl.flock, []

    def holder_lets_go_first(fd, operation):  # the holder's exit unlinks the file this taker opened
        if not calls:
            os.unlink(lock_path(target))
        calls.append(fd)
        return real_flock(fd, operation)

    monkeypatch.setattr(file_lock.fcntl, "flock", holder_lets_go_first)
    hold_for_process(target, refusal=_refusal)
    assert len(calls) == 2  # the unlinked file was left and the new one taken
    assert lock_path(target).read_text() == f"{os.getpid()}\n"


def test_exit_leaves_a_lock_file_that_is_no_longer_the_holders(tmp_path):
    target = tmp_path / "ck.pt"
    hold_for_process(target, refusal=_refusal)
    os.unlink(lock_path(target))
    lock_path(target).write_text("someone else's\n")
    release_all()
    assert lock_path(target).read_text() == "someone else's\n"


def test_a_resume_from_a_location_it_cannot_write_holds_nothing_and_a_checkpoint_there_names_the_write(
        tmp_path, monkeypatch):
    # A read-only location (a mount, another user's run): resuming from it worked before the lock and
    # still does; a checkpoint() there fails as its write would, in one line.
    world = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
                  backend="none", timeout_s=10.0)
    model = torch.nn.Linear(3, 2)
    kept = dict(world=world, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), global_batch_size=4,
                seed=0)
    script_checkpoint.checkpoint(tmp_path, epoch=1, **kept)
    release_all()

    def read_only(path):
        raise WriteFailed.of(path, OSError(errno.EROFS, "Read-only file system"))

    monkeypatch.setattr(file_lock, "_open", read_only)
    assert script_checkpoint.resume(tmp_path, **kept).epoch == 1
    with pytest.raises(WriteFailed, match=r"^cannot write .*/\.checkpoint\.pt\.lock \(Read-only file system\); the "
                                          r"filesystem is mounted read-only; choose a writable directory$"):
        script_checkpoint.checkpoint(tmp_path, epoch=2, **kept)
