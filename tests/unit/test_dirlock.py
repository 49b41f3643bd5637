"""One run per output directory (dirlock.py): a held --out or checkpoint dir is refused in one line
naming the holder's pid; the lock dies with its holder (even SIGKILLed); directories made only to
be locked are removed again; an earlier run's outputs are kept unless the run resumes or says
--overwrite; a resume refuses a damaged metrics.jsonl before any worker starts. Here, in one process: the rules that need no holder; tests/distributed/test_outdir_lock.py
holds the lock in a real second process."""

import os
import threading

import pytest

from phalanx.errors import UsageError
from phalanx.job.checkpointing import CheckpointConfig
from phalanx.job.config import TrainConfig
from phalanx.job.dirlock import PID_FILE, hold_run_directories


def _config(*, out_dir: str, checkpoint_dir: str | None = None, checkpoint_every: str | None = None,
            resume: str | None = None, overwrite: bool = False) -> TrainConfig:
    """The job's config with the options the directory lock reads (--out, --overwrite, the checkpoint's)."""
    return TrainConfig(out_dir=out_dir, overwrite=overwrite,
                       checkpoint=CheckpointConfig(directory=checkpoint_dir, every=checkpoint_every, resume=resume))


def test_out_and_checkpoint_dir_may_be_one_directory(tmp_path):
    out = tmp_path / "S"
    with hold_run_directories(_config(out_dir=str(out), checkpoint_dir=str(out), checkpoint_every="5")):
        assert out.is_dir()


def test_a_nested_new_directory_is_created_for_the_run_and_removed_if_left_empty(tmp_path):
    out = tmp_path / "a" / "b" / "run"
    with hold_run_directories(_config(out_dir=str(out), checkpoint_every="epoch")):
        assert (out / "checkpoints").is_dir()
    assert not (tmp_path / "a").exists()
    with hold_run_directories(_config(out_dir=str(out))):
        (out / "model.pt").write_bytes(b"weights")  # what a finished run leaves
    assert sorted(p.name for p in out.iterdir()) == ["model.pt"]


def test_an_earlier_runs_outputs_are_kept_unless_resumed_or_overwritten(tmp_path):
    out = tmp_path / "S"
    (out / "checkpoints").mkdir(parents=True)
    for name in ("metrics.jsonl", "model.pt", "checkpoints/checkpoint.pt", "notes.txt"):
        (out / name).write_text("earlier")
    (out / "metrics.jsonl").write_text('{"epoch": 1}\n')  # a resume reads it
    with pytest.raises(UsageError) as info:
        with hold_run_directories(_config(out_dir=str(out), checkpoint_every="5")):
            pytest.fail("overwrote an earlier run")
    assert str(info.value) == (f"--out {out} holds an earlier run's outputs (metrics.jsonl, model.pt, "
                               "checkpoints/checkpoint.pt); continue that run with --resume auto, or replace them "
                               "with --overwrite")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "metrics.jsonl", "model.pt", "notes.txt"]
    with hold_run_directories(_config(out_dir=str(out), checkpoint_every="5", resume="auto")):
        assert (out / "model.pt").read_text() == "earlier"  # continued, not cleared
    with hold_run_directories(_config(out_dir=str(out), checkpoint_every="5", overwrite=True)):
        assert {p.name for p in out.iterdir()} == {"checkpoints", "notes.txt", PID_FILE}
        assert [p.name for p in (out / "checkpoints").iterdir()] == [PID_FILE]
    assert (out / "notes.txt").read_text() == "earlier"  # not ours: never touched


def test_outputs_with_no_checkpoint_are_not_replaced_by_a_resume_that_would_start_over(tmp_path):
    # A finished run without --checkpoint-every: --resume auto has nothing to continue from, would
    # train from scratch and replace its outputs; neither message may suggest it.
    out = tmp_path / "S"
    out.mkdir()
    for name in ("metrics.jsonl", "model.pt"):
        (out / name).write_text("earlier")
    (out / "metrics.jsonl").write_text('{"epoch": 1}\n')  # a resume reads it
    for resume, found in ((None, "it saved no checkpoint"),
                          ("auto", "--resume auto found no checkpoint in it to continue from")):
        with pytest.raises(UsageError) as info:
            with hold_run_directories(_config(out_dir=str(out), resume=resume)):
                pytest.fail("replaced an earlier run's outputs")
        assert str(info.value) == (f"--out {out} holds an earlier run's outputs (metrics.jsonl, model.pt) and {found} "
                                   "(a run checkpoints with --checkpoint-every); replace them with --overwrite, or "
                                   "pick another directory")
        assert (out / "model.pt").read_text() == "earlier"
    (out / "checkpoint.pt").write_text("named")  # an explicit checkpoint file: that run continues
    with hold_run_directories(_config(out_dir=str(out), resume=str(out / "checkpoint.pt"))):
        assert (out / "model.pt").read_text() == "earlier"


def test_a_checkpoint_left_under_out_counts_even_when_this_run_keeps_none(tmp_path):
    out = tmp_path / "S"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "checkpoint.pt").write_text("earlier")  # a later --resume auto would pick it up
    with pytest.raises(UsageError, match=r"holds an earlier run's outputs \(checkpoints/checkpoint\.pt\)"):
        with hold_run_directories(_config(out_dir=str(out))):
            pass
    with hold_run_directories(_config(out_dir=str(out), overwrite=True)):
        assert not (out / "checkpoints" / "checkpoint.pt").exists()
    elsewhere = tmp_path / "elsewhere"  # a checkpoint dir this run neither writes nor reads: not its business
    elsewhere.mkdir()
    (elsewhere / "checkpoint.pt").write_text("another run's")
    with hold_run_directories(_config(out_dir=str(tmp_path / "T"), checkpoint_dir=str(elsewhere))):
        pass


def test_both_checkpoint_generations_are_earlier_outputs_and_overwrite_removes_both(tmp_path):
    out = tmp_path / "S"
    (out / "checkpoints").mkdir(parents=True)
    for name in ("checkpoint.pt", "checkpoint.previous.pt"):
        (out / "checkpoints" / name).write_text("earlier")
    with pytest.raises(UsageError, match=r"holds an earlier run's outputs \(checkpoints/checkpoint\.pt\); continue"):
        with hold_run_directories(_config(out_dir=str(out), checkpoint_every="5")):
            pass
    (out / "checkpoints" / "checkpoint.pt").unlink()  # the one before it alone would still be resumed from
    with pytest.raises(UsageError, match=r"\(checkpoints/checkpoint\.previous\.pt\); continue"):
        with hold_run_directories(_config(out_dir=str(out), checkpoint_every="5")):
            pass
    with hold_run_directories(_config(out_dir=str(out), checkpoint_every="5", overwrite=True)):
        assert [p.name for p in (out / "checkpoints").iterdir()] == [PID_FILE]


def test_temporary_files_of_a_killed_runs_writes_are_removed_under_the_lock(tmp_path):
    # A worker SIGKILLed mid-save (after the launcher's grace period) leaves its atomic write's
    # temporary file; the next run holding the directory removes it, and nothing else.
    from phalanx.atomic import atomic_open

    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    out.mkdir()
    ckpt.mkdir()
    stale = [ckpt / ".checkpoint.pt.ab3_9xyz.tmp", ckpt / ".checkpoint.shard-1-of-2.4.pt.k2m8q0zz.tmp",
             out / ".model.pt.0a1b2c3d.tmp"]
    kept = [out / ".notes.tmp", out / "model.pt", ckpt / "checkpoint.pt", out / ".x.ABCDEFGH.tmp"]
    for path in stale + kept:
        path.write_bytes(b"x")
    with atomic_open(tmp_path / "probe.pt") as handle:  # the name atomic_open really gives
        made = [p for p in tmp_path.iterdir() if p.name.startswith(".probe.pt.")]
        handle.write(b"x")
    from phalanx.atomic import _TEMPORARY
    assert len(made) == 1 and _TEMPORARY.match(made[0].name)
    with hold_run_directories(_config(out_dir=str(out), checkpoint_dir=str(ckpt), checkpoint_every="5",
                                      resume="auto")):
        assert not [p for p in stale if p.exists()]
        assert all(p.exists() for p in kept)


def test_without_a_lock_only_the_temporaries_of_writers_that_are_gone_are_removed(tmp_path):
    # A script's phalanx.resume holds no lock: a live writer's file (this process's) must stay.
    from phalanx.atomic import _WRITER, atomic_open, remove_stale_temporaries
    from phalanx.runtime.procs import process_alive

    dead = int(open("/proc/sys/kernel/pid_max").read()) + 1  # no process has it
    orphan = tmp_path / f".checkpoint.pt.p{dead}.ab3_9xyz.tmp"
    kept = [tmp_path / f".checkpoint.pt.p{os.getpid()}.k2m8q0zz.tmp", tmp_path / ".checkpoint.pt.ab3_9xyz.tmp",
            tmp_path / "checkpoint.pt"]
    for path in [orphan, *kept]:
        path.write_bytes(b"x")
    with atomic_open(tmp_path / "probe.pt") as handle:  # the name atomic_open gives carries its pid
        made = [p for p in tmp_path.iterdir() if p.name.startswith(".probe.pt.")]
        handle.write(b"x")
    assert len(made) == 1 and int(_WRITER.search(made[0].name)[1]) == os.getpid()
    assert remove_stale_temporaries(tmp_path, writer_alive=process_alive) == [orphan]
    assert all(p.exists() for p in kept)


def test_a_trace_directory_is_held_as_out_is(tmp_path):
    """Two runs with one --trace both ended 0, the second's traces over the first's (an operator's trial)."""
    from dataclasses import replace

    first = replace(_config(out_dir=str(tmp_path / "a")), trace_dir=str(tmp_path / "trace"))
    second = replace(_config(out_dir=str(tmp_path / "b")), trace_dir=str(tmp_path / "trace"))
    with hold_run_directories(first):
        with pytest.raises(UsageError, match=r"^--trace .*trace is in use by another phalanx run \(pid \d+\)"):
            with hold_run_directories(second):
                pass
    with hold_run_directories(second):  # free again once the first is over
        pass


@pytest.mark.parametrize("damage", [b'{"epoch": 1, "train_loss": 0.5}\n{"epoch": 2, "train_lo', b"\xff\xfe\n", b"[1, 2]\n"])
def test_a_resume_refuses_a_damaged_metrics_file_in_one_line_and_leaves_it(tmp_path, damage):
    # metrics.jsonl is rewritten whole and atomically: a torn or foreign line was made elsewhere
    # (truncate, a copy cut short); resuming over it would rewrite it from what could be read.
    out = tmp_path / "S"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "checkpoint.pt").write_text("earlier")
    (out / "metrics.jsonl").write_bytes(damage)
    with pytest.raises(UsageError) as info:
        with hold_run_directories(_config(out_dir=str(out), checkpoint_every="5", resume="auto")):
            pytest.fail("resumed over a damaged metrics.jsonl")
    message = str(info.value)
    assert message.startswith(f"{out / 'metrics.jsonl'} is damaged: line ") and "\n" not in message, message
    assert "restore it from a copy, or delete it to resume without its rows" in message
    assert (out / "metrics.jsonl").read_bytes() == damage


def test_a_link_left_at_the_pid_files_name_is_replaced_not_written_through(tmp_path):
    # A directory another user can write (a shared project or scratch directory): before, the pid
    # was written through their link, clobbering the file it names with this run's pid.
    out, victim = tmp_path / "shared", tmp_path / "victim.conf"
    out.mkdir()
    victim.write_text("this user's file\n")
    (out / PID_FILE).symlink_to(victim)
    with hold_run_directories(_config(out_dir=str(out))):
        assert not (out / PID_FILE).is_symlink() and (out / PID_FILE).read_text() == f"{os.getpid()}\n"
    assert victim.read_text() == "this user's file\n"
    assert not (out / PID_FILE).exists()


def test_a_fifo_at_the_pid_files_name_hangs_neither_the_run_nor_a_refused_one(tmp_path):
    # Before: opening the FIFO to write the pid, or to read the holder's, waited for ever.
    out = tmp_path / "shared"
    out.mkdir()
    os.mkfifo(out / PID_FILE)
    outcome = []

    def run():
        with hold_run_directories(_config(out_dir=str(out))):
            (out / PID_FILE).unlink()
            os.mkfifo(out / PID_FILE)  # planted while the run holds the directory
            with pytest.raises(UsageError) as info:
                with hold_run_directories(_config(out_dir=str(out))):
                    pytest.fail("a held directory was taken twice")
            outcome.append(str(info.value))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=20)
    assert not thread.is_alive(), "hung on a FIFO at the pid file's name"
    assert outcome == [f"--out {out} is in use by another phalanx run (pid unknown); wait for it to end or "
                       "pick another directory"]
