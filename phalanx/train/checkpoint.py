"""Checkpoints: save a run's whole state atomically, load it only after checking it fits.

A checkpoint is one file, `<dir>/checkpoint.pt`, replaced atomically (temp file, fsync, rename:
a kill during a save leaves the previous checkpoint whole). It holds the model's and optimizer's
state, where the run stands (epoch, steps done in that epoch), every rank's RNG states (torch,
numpy, python), and a fingerprint of what produced it (model, parameter names and shapes,
global batch size, seed, dtype). The data position needs nothing more: each epoch's order is a
permutation seeded by (seed, epoch), so skipping the steps already done puts every rank exactly
where it was, and a resumed run ends with the same parameters as an uninterrupted one.

`resume_run` is where `phalanx train` starts (a checkpoint named by --resume, or found by a
torchrun restart); `checkpoint`/`resume` are a user script's. Rank 0 writes; every rank reads.
Loading uses `torch.load(..., weights_only=True)` - a file that needs arbitrary unpickling
(tampered, or not a checkpoint) is refused - and compares the fingerprint with the current run
before anything is applied, naming the first mismatch.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from phalanx.atomic import atomic_write_bytes
from phalanx.errors import UsageError
from phalanx.parallel.data_parallel import DataParallel
from phalanx.train.config import TrainConfig
from phalanx.world import World, launcher_env

FORMAT = "phalanx-checkpoint-1"
FILENAME = "checkpoint.pt"


@dataclass(frozen=True, kw_only=True)
class Position:
    """Where a run stands: `step` steps of epoch `epoch` (0-based) are done.

    `epoch_totals`: this rank's running sums over those steps (loss sum, correct, examples,
    seconds), so a run resumed mid-epoch reports the same epoch metrics as an uninterrupted one.
    """

    epoch: int
    step: int
    epoch_totals: tuple[float, ...] = ()


def fingerprint(model: torch.nn.Module, *, model_name: str, global_batch_size: int, seed: int, dtype: str) -> dict:
    """What a checkpoint must agree on with the run that loads it."""
    return {"model": model_name, "global_batch_size": global_batch_size, "seed": seed, "dtype": dtype,
            "parameters": [[name, list(p.shape)] for name, p in model.named_parameters()]}


def run_fingerprint(config: TrainConfig, model: torch.nn.Module) -> dict:
    """A `phalanx train` run's fingerprint: its whole model and the settings that decide the update."""
    return fingerprint(model, model_name=config.model, global_batch_size=config.global_batch_size, seed=config.seed,
                       dtype=config.dtype)


def checkpoint_path(location: str | Path) -> Path:
    """A checkpoint file, or a directory holding one as checkpoint.pt."""
    path = Path(location)
    return path / FILENAME if path.is_dir() or not path.suffix else path


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "numpy": {"key": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                      "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
            "python": _to_lists(random.getstate())}


def _to_lists(value):
    return [_to_lists(v) for v in value] if isinstance(value, (tuple, list)) else value


def _to_tuples(value):
    return tuple(_to_tuples(v) for v in value) if isinstance(value, list) else value


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    random.setstate(_to_tuples(state["python"]))


def save_checkpoint(directory: str | Path, *, world: World, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    position: Position, fingerprint: dict) -> Path | None:
    """Every rank calls this (RNG states are gathered); rank 0 writes. Returns the path on rank 0."""
    mine = {"rng": _rng_state(), "epoch_totals": [float(v) for v in position.epoch_totals]}
    if world.distributed:
        every = [None] * world.world_size
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    if not world.is_main:
        return None
    state = {"format": FORMAT, "epoch": position.epoch, "step": position.step, "fingerprint": fingerprint,
             "model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
             "optimizer": optimizer.state_dict(), "rng": [r["rng"] for r in every],
             "epoch_totals": [r["epoch_totals"] for r in every]}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    path = checkpoint_path(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buffer.getvalue())
    return path


def read_checkpoint(location: str | Path) -> dict[str, Any]:
    """Load a checkpoint file as weights only; a clear UsageError for anything else."""
    path = checkpoint_path(location)
    if not path.is_file():
        raise UsageError(f"no checkpoint at {path}; pass --resume a directory holding {FILENAME} (or the file)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - pickle, zip and weights-only errors alike
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"{path} is not loadable as a weights-only checkpoint ({reason[:160]}); it is corrupt, "
                         "tampered with or not a phalanx checkpoint - resume from another one") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UsageError(f"{path} is not a phalanx checkpoint (format {state.get('format') if isinstance(state, dict) else None!r}); "
                         "resume from a checkpoint phalanx train wrote")
    return state


def check_compatible(state: dict[str, Any], expected: dict, *, path: str | Path) -> None:
    """Refuse a checkpoint whose fingerprint differs from this run's, naming the first field."""
    saved = state["fingerprint"]
    flags = {"model": "--model", "global_batch_size": "--batch-size", "seed": "--seed", "dtype": "--dtype"}
    for field, flag in flags.items():
        if saved.get(field) != expected[field]:
            raise UsageError(f"checkpoint {path} was saved with {flag} {saved.get(field)} but this run has "
                             f"{flag} {expected[field]}; resume with the same settings")
    mine, theirs = dict(map(tuple, [(n, tuple(s)) for n, s in expected["parameters"]])), \
        dict((n, tuple(s)) for n, s in saved["parameters"])
    for name in sorted(set(mine) | set(theirs)):
        if mine.get(name) != theirs.get(name):
            raise UsageError(f"checkpoint {path} does not fit this model: parameter {name} is "
                             f"{theirs.get(name)} there and {mine.get(name)} here; resume with the model that saved it")


def restore(state: dict[str, Any], *, world: World, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Position:
    """Apply a checked checkpoint on this rank; return where to continue."""
    own = {k: v for k, v in model.state_dict().items()}
    for key, value in state["model"].items():
        if key in own and own[key].shape != value.shape:
            raise UsageError(f"checkpoint tensor {key} has shape {tuple(value.shape)}, the model {tuple(own[key].shape)}; "
                             "resume with the model that saved it")
    model.load_state_dict(state["model"])
    try:
        optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError) as exc:
        raise UsageError(f"checkpoint optimizer state does not fit ({exc}); resume with the same optimizer settings") from None
    rng = state["rng"]
    _set_rng_state(rng[world.rank] if world.rank < len(rng) else rng[0])
    totals = state.get("epoch_totals") or [[]]
    mine = totals[world.rank] if world.rank < len(totals) else []
    return Position(epoch=int(state["epoch"]), step=int(state["step"]), epoch_totals=tuple(mine))


def resume_run(config: TrainConfig, *, world: World, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               log: Callable[[str], None]) -> Position:
    """Where a `phalanx train` run starts: a checkpoint's position, or epoch 0, step 0.

    From `--resume DIR`, `--resume auto` (the checkpoint dir's checkpoint if there is one), or -
    when torchrun restarts a job that checkpoints - auto. The checkpoint is checked against and
    restored into `model`, the whole model (whichever way the run splits it), and `optimizer`,
    one over that model's parameters.
    """
    resume = config.resume
    env = launcher_env()
    if resume is None and config.checkpoint_every is not None and env is not None and env.restart_count > 0:
        resume = "auto"  # torchrun restarted the job: pick up where the last checkpoint left off
    if resume == "auto":
        resume = config.checkpoint_location
        if not checkpoint_path(resume).is_file():
            log(f"no checkpoint in {resume} yet: starting from scratch")
            return Position(epoch=0, step=0)
    if resume is None:
        return Position(epoch=0, step=0)
    state = read_checkpoint(resume)
    check_compatible(state, run_fingerprint(config, model), path=checkpoint_path(resume))
    position = restore(state, world=world, model=model, optimizer=optimizer)
    log(f"resumed from {checkpoint_path(resume)} at epoch {position.epoch + 1}, step {position.step}")
    return position


def _replica(model) -> torch.nn.Module:
    """The module itself, given a module or a DataParallel around one (itself an nn.Module: the
    fingerprint names the user's model class, not the wrapper)."""
    return model.module if isinstance(model, DataParallel) else model


def _script_fingerprint(module: torch.nn.Module, *, global_batch_size: int, seed: int) -> dict:
    dtype = str(next(module.parameters()).dtype).removeprefix("torch.")
    return fingerprint(module, model_name=type(module).__name__, global_batch_size=global_batch_size, seed=seed,
                       dtype=dtype)


def checkpoint(location: str | Path, *, world: World, model, optimizer: torch.optim.Optimizer, epoch: int,
               step: int = 0, global_batch_size: int, seed: int) -> Path | None:
    """A user script's checkpoint: `step` steps of `epoch` (0-based) are done. Every rank calls it.

    Holds what `phalanx train`'s do (weights, optimizer state, every rank's RNG states, position)
    plus a fingerprint of the model class, parameter shapes, global batch size, seed and dtype
    that `resume` checks. `model`: the module or its DataParallel. Rank 0 writes, atomically.
    """
    module = _replica(model)
    return save_checkpoint(location, world=world, model=module, optimizer=optimizer,
                           position=Position(epoch=epoch, step=step),
                           fingerprint=_script_fingerprint(module, global_batch_size=global_batch_size, seed=seed))


def resume(location: str | Path, *, world: World, model, optimizer: torch.optim.Optimizer, global_batch_size: int,
           seed: int) -> Position:
    """Continue from `location`'s checkpoint if there is one (else epoch 0, step 0).

    Restores weights, optimizer state and this rank's RNG states after checking the checkpoint
    fits (a one-line UsageError otherwise). With a `ShardedLoader` seeded the same, skipping the
    returned position's `step` batches of its `epoch` continues exactly as an uninterrupted run.
    """
    path = checkpoint_path(location)
    if not path.is_file():
        return Position(epoch=0, step=0)
    module = _replica(model)
    state = read_checkpoint(path)
    check_compatible(state, _script_fingerprint(module, global_batch_size=global_batch_size, seed=seed), path=path)
    return restore(state, world=world, model=module, optimizer=optimizer)
