"""A user script's checkpoints: `phalanx.checkpoint` and `phalanx.resume`, on checkpoint.py's format.

What a script hands over by keyword is what is saved and restored: the replica (or its module),
the optimizer, `extras` (its scheduler, GradScaler, EMA: checkpoint_extras.py) and its
`phalanx.ShardedLoader` (`loader=`: every rank's RNG states at its epoch's start, so a resumed
epoch replays the skipped batches' random draws: loader_resume.py). The fingerprint it checks is
the model class, parameter shapes, global batch size, seed and dtype, named as the script spells
them.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from phalanx.atomic import make_dir, remove_stale_temporaries
from phalanx.comm import Tag, agreed_outcome
from phalanx.data_parallel.data_parallel import DataParallel
from phalanx.errors import UsageError, WriteFailed, warn_at_caller
from phalanx.file_lock import hold_for_process
from phalanx.runtime.call_habits import phalanx_call
from phalanx.runtime.procs import process_alive
from phalanx.runtime.world import World
from phalanx.train.checkpoint import Position, check_compatible, checkpoint_path, fingerprint, has_checkpoint, \
    read_newest, restore, save_checkpoint, set_aside_passed_over
from phalanx.train.checkpoint_extras import checked_extras, extra_states
from phalanx.train.loader_resume import hand_to_loader, loader_record
from phalanx.train.sharded_loader import IN_EPOCH

SCRIPT_NAMES = {"model": "model class {}", "global_batch_size": "global_batch_size={}", "seed": "seed={}",
                "dtype": "parameters of dtype {}"}


def _replica(model) -> torch.nn.Module:
    """The module itself, given a module or a DataParallel around one (itself an nn.Module: the
    fingerprint names the user's model class, not the wrapper)."""
    return model.module if isinstance(model, DataParallel) else model


def _sharded(model):
    """The replica itself when `model` is a sharded DataParallel (its ranks save shares), else None."""
    return model if isinstance(model, DataParallel) and model.sharding is not None else None


def _script_fingerprint(module: torch.nn.Module, *, global_batch_size: int, seed: int) -> dict:
    dtype = str(next(module.parameters()).dtype).removeprefix("torch.")
    return fingerprint(module, model_name=type(module).__name__, global_batch_size=global_batch_size, seed=seed,
                       dtype=dtype)


@phalanx_call(first=(str, os.PathLike))  # Fabric's save(path, state): one line
def checkpoint(location: str | Path, *, world: World, model, optimizer: torch.optim.Optimizer, epoch: int,
               step: int = 0, global_batch_size: int, seed: int, extras: dict | None = None,
               loader=None) -> Path | None:
    """A user script's checkpoint: `step` steps of `epoch` (0-based) are done. Every rank calls it.

    Holds what `phalanx train`'s do (weights, optimizer state, every rank's RNG states, position)
    plus a fingerprint of the model class, parameter shapes, global batch size, seed and dtype
    that `resume` checks. `model`: the module or its DataParallel, whose gradients since its last
    NaN/Inf check are checked first, and its replicas and `optimizer` compared across ranks
    (NonFinite names step and rank, ReplicaMismatch the ranks that differ: nothing non-finite, nor
    one rank's diverged model, is saved).
    `extras`: the rest of the training state by name, `{"scheduler": scheduler, "scaler": scaler}`:
    each object's `state_dict()` (rank 0's: they are replicated like the model). `loader`: the
    `phalanx.ShardedLoader` the loop reads, whose every rank's RNG states at the epoch's start make
    a resume at `step` exact for data that draws random numbers. Rank 0 writes, atomically, and holds
    `location` for the rest of its process: another job given it stops in one line (file_lock.py)."""
    world.check_here("phalanx.checkpoint")
    _check_location(location, "phalanx.checkpoint")
    _check_optimizer(optimizer, "phalanx.checkpoint")
    states = extra_states(extras)  # every rank, before any collective: a bad extra fails alike everywhere
    _name_the_loader_left_out(loader, step=step, world=world)
    if isinstance(model, DataParallel):
        model.check_finite(where="phalanx.checkpoint()")
        model.check_replicas(where="phalanx.checkpoint()", optimizers=[optimizer])
    # After the checks: a refused checkpoint leaves nothing, not even its directory. A location rank 0
    # cannot make or hold raises on every rank (comm/agreed.py), as a failed write does.
    with agreed_outcome(world, Tag("checkpoint")):
        if world.is_main:
            path = checkpoint_path(location)
            make_dir(path.parent, named="phalanx.checkpoint's location")
            _hold(path, "phalanx.checkpoint")
    module = _replica(model)
    return save_checkpoint(location, world=world, model=module, optimizer=optimizer,
                           position=Position(epoch=epoch, step=step),
                           fingerprint=_script_fingerprint(module, global_batch_size=global_batch_size, seed=seed),
                           dp=_sharded(model), extras=states, loader_record=loader_record(loader))


def _check_location(location, caller: str) -> None:
    """An empty location (an unset variable's default) would be the working directory to Path:
    refused on every rank, before any collective, as the CLI refuses an empty --out."""
    if not isinstance(location, (str, os.PathLike)):
        raise UsageError(f"{caller}'s location is a {type(location).__name__}; pass a directory or a file path")
    if not os.fspath(location):
        raise UsageError(f"{caller}'s location is empty; name a directory (or a .pt file) to keep the checkpoint in")


def _check_optimizer(optimizer, caller: str) -> None:
    """The optimizer is part of what resumes exactly (its moments, its step count): a None or a
    stand-in is refused on every rank, before any collective, instead of an AttributeError in the save."""
    if not (hasattr(optimizer, "param_groups") and hasattr(optimizer, "state_dict")):
        raise UsageError(f"{caller} needs optimizer=, the optimizer the loop steps (its state is what makes the resume "
                         f"exact), got {type(optimizer).__name__}; to keep the weights alone, "
                         "torch.save(dp.state_dict(), path) on rank 0 (if world.is_main)")


def _hold(path: Path, caller: str) -> None:
    """Rank 0 holds the checkpoint `path` for the rest of the job (file_lock.py)."""
    hold_for_process(path, refusal=lambda holder: (
        f"{caller}: {path} is the checkpoint of another job ({holder}, its rank 0), and two jobs writing one "
        "checkpoint resume from each other's; wait for that job to end, or give this one another location"))


_SAID = []  # the warning below, once a process


def _name_the_loader_left_out(loader, *, step: int, world: World) -> None:
    """Rank 0 warns, once, of a mid-epoch checkpoint without `loader=` while a ShardedLoader of
    this process is inside an epoch: its resume would load the done batches again from the
    checkpoint's RNG states, and drift where loading them draws random numbers in this process
    (augmentation in `__getitem__` with `num_workers=0`); loader workers' seeds and the step's
    own draws (dropout) do not depend on it (each epoch's workers are seeded by (seed, epoch))."""
    if loader is None and step > 0 and world.is_main and IN_EPOCH and not _SAID:
        _SAID.append(True)
        warn_at_caller(f"phalanx.checkpoint at step {step} of an epoch without loader=: pass loader=loader (here and "
                       "to phalanx.resume) so that a resume replays the done batches' random draws; without it a "
                       "resume loads them again from the checkpoint's RNG states, and draws made while loading them "
                       "in this process (augmentation in __getitem__ with num_workers=0, a collate that draws) move "
                       "the run off the uninterrupted one")


@phalanx_call(first=(str, os.PathLike))
def resume(location: str | Path, *, world: World, model, optimizer: torch.optim.Optimizer, global_batch_size: int,
           seed: int, extras: dict | None = None, loader=None) -> Position:
    """Continue from `location`'s checkpoint if there is one (else epoch 0, step 0).

    Restores weights, optimizer state, `extras`' states (the objects `checkpoint` was given, by
    the same names) and this rank's RNG states after checking the checkpoint fits (a one-line
    UsageError otherwise). With a `ShardedLoader` seeded the same, skipping the returned
    position's `step` batches of its `epoch` continues exactly as an uninterrupted run; with
    `loader=` (passed to `checkpoint` too) also when the data draws random numbers: the loader
    replays the skipped batches' draws (loader_resume.py).
    """
    world.check_here("phalanx.resume")
    _check_location(location, "phalanx.resume")
    _check_optimizer(optimizer, "phalanx.resume")
    checked_extras(extras)  # a wrong one fails on the first run too, not only when a checkpoint exists
    with agreed_outcome(world, Tag("checkpoint")):  # another job's location: refused on every rank, as checkpoint's
        if world.is_main:
            path = checkpoint_path(location)
            if path.parent.is_dir():  # else nothing to resume, nor to guard yet
                # A location this job cannot write (read-only, another user's) holds nothing: it writes
                # nothing there to guard, and a checkpoint() there names the failed write.
                with contextlib.suppress(WriteFailed):
                    _hold(path, "phalanx.resume")
            # What a worker killed during a write left (another job's writes may be in progress).
            remove_stale_temporaries(path.parent, writer_alive=process_alive)
    if not has_checkpoint(location):
        return Position(epoch=0, step=0)
    module = _replica(model)
    path, state, passed_over = read_newest(location)
    if passed_over and world.is_main:
        kept = set_aside_passed_over(location, path, world=world)
        warn_at_caller(f"resuming from {path}: {passed_over}{kept}")  # the script's resume line
    check_compatible(state, _script_fingerprint(module, global_batch_size=global_batch_size, seed=seed), path=path,
                     names=SCRIPT_NAMES)
    position = restore(state, world=world, model=module, optimizer=optimizer, dp=_sharded(model), path=path,
                       extras=extras)
    hand_to_loader(state, loader=loader, rank=world.rank, is_main=world.is_main, path=path)
    return position
