"""Checkpoints: save a run's whole state atomically, load it only after checking it fits.

A checkpoint is one file, `<dir>/checkpoint.pt`, replaced atomically (temp file, fsync, rename:
a kill during a save leaves the previous checkpoint whole), and the one it replaced is kept as
`checkpoint.previous.pt` (checkpoint_files.py: two generations, every record CRC-checked before
anything is loaded). It holds the model's and optimizer's state, where the run stands (epoch, steps done in that epoch, and the epoch's running sums
reduced over every rank, so a run resumed on any device count reports the same epoch metrics),
every rank's RNG states (torch, numpy, python), a script's `extras` (its learning-rate
scheduler, GradScaler, EMA: checkpoint_extras.py), a fingerprint of what produced it (model,
parameter names and shapes, global batch size, seed, dtype, and for `phalanx train` the data
set's name, sizes and a hash of the training set's bytes) and the settings that may change on
resume (lr, warm-up, epochs, device count: a resumed run says which did). The data position:
each epoch's order is a permutation seeded by (seed, epoch), so skipping the steps already done
puts every rank where it was; a script's loader also leaves each rank's RNG states at its epoch's
start, for data that draws random numbers (loader_resume.py). Checkpoints of the first format (per-rank sums, no data
identity) still load: their sums are added up, and the data set is reported as unchecked.

`phalanx train`'s own use (what it fingerprints, where it starts) is in resume.py; a
script's `phalanx.checkpoint`/`phalanx.resume` in script_checkpoint.py. Rank 0 writes; every rank reads.
Loading checks the file's CRCs, then uses `torch.load(..., weights_only=True)` - a file that needs
arbitrary unpickling (tampered, or not a checkpoint) is refused - and compares the fingerprint
with the current run before anything is applied, naming the first mismatch. A directory's
damaged (or missing) newest checkpoint gives way to the one before it, and the reader says so;
the damaged one is then set aside (checkpoint.damaged.pt), so the next save cannot rotate it
over the intact one. Each rank's own running sums are kept too: resumed on the same device
count, every rank continues its own sums in the order an uninterrupted run adds them, so the
epoch's row is bitwise the same.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from phalanx.comm import Tag, agreed_outcome, collective
from phalanx.errors import UsageError
from phalanx.runtime.world import World
from phalanx.train.checkpoint_extras import check_extra_names, load_extras
from phalanx.train.checkpoint_files import DamagedFile, newest_intact, previous_of, read_verified, serialize, \
    set_aside, write_generation
from phalanx.train.loader_resume import of_rank
from phalanx.train.rng_state import rng_state, set_rng_state
from phalanx.train.sharded_checkpoint import FORMAT_SHARDED, check_shares, optimizer_names, restore_any, save_sharded

FORMAT = "phalanx-checkpoint-2"
# Still read: the first format kept each rank's running sums and no data identity.
FORMAT_1 = "phalanx-checkpoint-1"
FILENAME = "checkpoint.pt"


@dataclass(frozen=True, kw_only=True)
class Position:
    """Where a run stands: `step` steps of epoch `epoch` (0-based) are done.

    `epoch_totals`: running sums over those steps (loss sum, correct, examples, seconds), this
    rank's when saving; restored on the device count that saved them, this rank's own (the epoch's
    row is bitwise an uninterrupted run's), on another rank 0 holds every rank's sums and the others
    zeros (the epoch's metrics add them up: the same row up to another order of additions).
    """

    epoch: int
    step: int
    epoch_totals: tuple[float, ...] = ()


def fingerprint(model: torch.nn.Module, *, model_name: str, global_batch_size: int, seed: int, dtype: str,
                data: dict | None = None, optimizer: str | None = None) -> dict:
    """What a checkpoint must agree on with the run that loads it (`data`: `dataset_identity`'s;
    `optimizer`: phalanx train's --optimizer)."""
    found = {"model": model_name, "global_batch_size": global_batch_size, "seed": seed, "dtype": dtype,
             "parameters": [[name, list(p.shape)] for name, p in model.named_parameters()]}
    if optimizer is not None:
        found["optimizer"] = optimizer
    return found if data is None else {**found, "data": data}


def checkpoint_path(location: str | Path) -> Path:
    """A checkpoint file, or a directory holding one as checkpoint.pt."""
    path = Path(location)
    return path / FILENAME if path.is_dir() or not (path.suffix or path.is_file()) else path


def generation_paths(location: str | Path) -> tuple[Path, Path]:
    """The files a save at `location` leaves: the checkpoint and the one before it."""
    path = checkpoint_path(location)
    return path, previous_of(path)


def has_checkpoint(location: str | Path) -> bool:
    """Whether `location` holds a checkpoint to resume from (either generation of a directory)."""
    path = checkpoint_path(location)
    return any(p.is_file() for p in (generation_paths(location) if path != Path(location) else (path,)))


def newest_state(location: str | Path | None) -> dict[str, Any] | None:
    """The state of the generation a resume at `location` would read (`read_newest`), or None where
    there is none yet, or none readable."""
    if location is None or not has_checkpoint(location):
        return None
    try:
        return read_newest(location)[1]
    except UsageError:  # DamagedFile included: every generation damaged
        return None


def save_checkpoint(directory: str | Path, *, world: World, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    position: Position, fingerprint: dict, settings: dict | None = None, dp=None,
                    extras: dict | None = None, loader_record: dict | None = None) -> Path | None:
    """Every rank calls this (RNG states and running sums are gathered); rank 0 writes. Returns
    the path on rank 0, on every rank once the checkpoint is whole on disk. `settings`: for the
    resumed run's log line. `dp`: a sharded replica, whose ranks each write their share
    (sharded_checkpoint.py). `extras`: a script's scheduler, scaler, ... (checkpoint_extras.py).
    `loader_record`: this rank's loader's epoch start (loader_resume.py). A failed write raises
    on every rank alike (comm/agreed.py), once the others know: rank 0's full disk is every rank's
    WriteFailed, so a script that catches it goes on in step."""
    mine = {"rng": rng_state(), "epoch_totals": [float(v) for v in position.epoch_totals], "loader": loader_record}
    if world.distributed:
        every = [None] * world.world_size
        with collective(world, Tag("checkpoint")):  # on the collective board: a mismatch names this call
            dist.all_gather_object(every, mine)
    else:
        every = [mine]
    if dp is not None and dp.sharding is not None:
        run_state = {"epoch": position.epoch, "step": position.step, "fingerprint": fingerprint,
                     "epoch_totals": _global_totals([r["epoch_totals"] for r in every]),
                     "rank_totals": [r["epoch_totals"] for r in every], "settings": dict(settings or {}),
                     "extras": dict(extras or {}), "loader": [r["loader"] for r in every]}
        return save_sharded(checkpoint_path(directory), world=world, dp=dp, optimizer=optimizer, run_state=run_state,
                            every=every)
    path = checkpoint_path(directory) if world.is_main else None
    with agreed_outcome(world, Tag("checkpoint")):  # rank 0 writes; every rank waits for it and learns how it went
        if world.is_main:
            write_generation(path, serialize(_whole_state(model, optimizer, position=position, fingerprint=fingerprint,
                                                          settings=settings, extras=extras, every=every)))
    return path


def save_alone(directory: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, position: Position,
               fingerprint: dict, settings: dict | None, every: list[dict], note: dict) -> Path:
    """One rank writes a replicated model's checkpoint with no collective: the survivors' save of
    a run whose peer died (job/survivors.py), `every` holding each rank's RNG states and sums as
    save_checkpoint gathers them, `note` what the file says of its making (the ranks lost)."""
    path = checkpoint_path(directory)
    state = _whole_state(model, optimizer, position=position, fingerprint=fingerprint, settings=settings, extras=None,
                         every=every)
    write_generation(path, serialize({**state, "survivors": note}))
    return path


def _whole_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, position: Position, fingerprint: dict,
                 settings: dict | None, extras: dict | None, every: list[dict]) -> dict[str, Any]:
    """The checkpoint of a replicated model, as rank 0 writes it: every rank's RNG states and sums in `every`."""
    return {"format": FORMAT, "epoch": position.epoch, "step": position.step, "fingerprint": fingerprint,
            "model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
            "optimizer": optimizer.state_dict(), "optimizer_names": optimizer_names(model, optimizer),
            "rng": [r["rng"] for r in every],
            "epoch_totals": _global_totals([r["epoch_totals"] for r in every]),
            "rank_totals": [r["epoch_totals"] for r in every], "settings": dict(settings or {}),
            "extras": dict(extras or {}), "loader": [r["loader"] for r in every]}


def _global_totals(per_rank: list[list[float]]) -> list[float]:
    """Every rank's (loss sum, correct, examples, seconds) as one run's: the sums added, rank 0's
    seconds (the time the log reports). Empty when no rank kept sums."""
    kept = [t for t in per_rank if len(t) == 4]
    seconds = float(per_rank[0][3]) if kept and len(per_rank[0]) == 4 else 0.0
    return [sum(t[i] for t in kept) for i in range(3)] + [seconds] if kept else []


def read_checkpoint(location: str | Path) -> dict[str, Any]:
    """Load a checkpoint file as weights only, its CRCs checked first (DamagedFile when damaged or
    unloadable); a clear UsageError for anything else."""
    path = checkpoint_path(location)
    if not path.is_file():
        raise UsageError(f"no checkpoint at {path}; pass --resume a directory holding {FILENAME} (or the file)")
    try:
        with warnings.catch_warnings():
            # torch's "Detected pickle protocol N" for a file torch.save did not write (a plain
            # pickle, a file someone swapped in): the line below says it, the warning's 2 lines came first.
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            state = torch.load(io.BytesIO(read_verified(path)), map_location="cpu", weights_only=True)
    except DamagedFile:
        raise
    except Exception as exc:  # noqa: BLE001 - pickle, zip and weights-only errors alike
        said = (str(exc).strip().splitlines() or [""])[0].split(". ")[0].rstrip(".")  # its first sentence
        reason = f"{type(exc).__name__}: {said if len(said) <= 160 else said[:157] + '...'}" if said else \
            "it is empty, 0 bytes" if path.stat().st_size == 0 else type(exc).__name__  # was "(EOFError: )"
        raise DamagedFile(path, f"is not loadable as a weights-only checkpoint ({reason}); it is corrupt, "
                                "tampered with or not a phalanx checkpoint") from None
    if not isinstance(state, dict) or state.get("format") not in (FORMAT, FORMAT_1, FORMAT_SHARDED):
        raise UsageError(f"{path} is not a phalanx checkpoint (format {state.get('format') if isinstance(state, dict) else None!r}); "
                         "resume from a checkpoint phalanx train wrote")
    if state["format"] == FORMAT_SHARDED:
        check_shares(path, state)  # a missing or damaged share makes this generation unusable
    return state


def read_newest(location: str | Path) -> tuple[Path, dict[str, Any], str]:
    """`read_checkpoint` of the newest intact generation: a directory's checkpoint.pt, or - when
    it is damaged or missing - the one before it; a file named on its own, that file only.
    Returns (the file read, its state, a note naming the newer one passed over, or '')."""
    path = checkpoint_path(location)
    return newest_intact(path, read_checkpoint, go_back=path != Path(location))


def set_aside_passed_over(location: str | Path, read: Path, *, world: World) -> str:
    """After `read_newest(location)` went back to `read`: rank 0 sets the damaged newest file aside
    (checkpoint_files.set_aside): the next save keeps `read`. The words for the resumed line, or ''."""
    newest = checkpoint_path(location)
    if not world.is_main or read == newest or not newest.is_file():
        return ""
    kept = set_aside(newest)
    return "" if kept is None else f" (kept as {kept.name}, no longer a checkpoint)"


# How a mismatched field is named: `phalanx train`'s flags (script_checkpoint.py: what a script passes).
CLI_NAMES = {"model": "--model {}", "global_batch_size": "--batch-size {}", "seed": "--seed {}",
             "dtype": "--dtype {}", "optimizer": "--optimizer {}"}


def check_compatible(state: dict[str, Any], expected: dict, *, path: str | Path, names: dict = CLI_NAMES) -> None:
    """Refuse a checkpoint whose fingerprint differs from this run's, naming the first field as
    `names` spells it (CLI_NAMES, or SCRIPT_NAMES for phalanx.resume)."""
    saved = state["fingerprint"]
    for field, name in names.items():
        if field not in expected:
            continue
        theirs = saved.get(field, "sgd" if field == "optimizer" else None)  # before --optimizer: SGD
        if theirs != expected[field]:
            raise UsageError(f"checkpoint {path} was saved with {name.format(theirs)} but this run has "
                             f"{name.format(expected[field])}; resume with the same settings")
    if "data" in saved and "data" in expected and saved["data"] != expected["data"]:
        raise UsageError(f"checkpoint {path} was trained on {_describe_data(saved['data'])} but this run has "
                         f"{_describe_data(expected['data'])}; resume with the data set it was trained on "
                         "(--dataset / --data-dir / --train-examples)")
    mine, theirs = dict(map(tuple, [(n, tuple(s)) for n, s in expected["parameters"]])), \
        dict((n, tuple(s)) for n, s in saved["parameters"])
    for name in sorted(set(mine) | set(theirs)):
        if mine.get(name) != theirs.get(name):
            raise UsageError(f"checkpoint {path} does not fit this model: parameter {name} is "
                             f"{theirs.get(name)} there and {mine.get(name)} here; resume with the model that saved it")


def _describe_data(identity: dict) -> str:
    return (f"{identity.get('name')} ({identity.get('num_train')} train / {identity.get('num_test')} test images, "
            f"sha256 {str(identity.get('train_sha256'))[:12]})")


def restore(state: dict[str, Any], *, world: World, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            dp=None, path: str | Path | None = None, extras: dict | None = None) -> Position:
    """Apply a checked checkpoint on this rank; return where to continue. `dp`: a sharded replica
    (`model` its module, `optimizer` its `dp.optimizer(...)`); whole and sharded checkpoints
    load into either (`path`: the sharded checkpoint's manifest, beside its shares). `extras`: a
    script's objects whose saved states are loaded into them (checkpoint_extras.py)."""
    where = path if path is not None else "(in memory)"
    check_extra_names(state.get("extras"), extras, path=where)  # before anything is applied
    own = {**{n: p for n, p in model.named_parameters()}, **dict(model.named_buffers())}
    for key, value in state["model"].items():
        if key in own and own[key].shape != value.shape:
            raise UsageError(f"checkpoint tensor {key} has shape {tuple(value.shape)}, the model {tuple(own[key].shape)}; "
                             "resume with the model that saved it")
    try:
        restore_any(state, path=Path(path) if path is not None else Path("."), module=model, optimizer=optimizer, dp=dp)
    except (ValueError, KeyError) as exc:
        raise UsageError(f"checkpoint optimizer state does not fit ({exc}); resume with the optimizer the saving run "
                         "had: its type and param groups (a group it added mid-run with add_param_group: add it "
                         "before resume)") from None
    load_extras(state.get("extras"), extras, path=where)
    set_rng_state(of_rank(state["rng"], world.rank))
    totals = state.get("epoch_totals") or []
    if state["format"] == FORMAT_1:  # one list per rank of the run that saved it
        totals = _global_totals(totals) if totals else []
    own = state.get("rank_totals") or []
    if len(own) == world.world_size and all(len(t) == 4 for t in own):  # the same ranks: each its own sums
        totals = own[world.rank]
    elif totals and not world.is_main:  # rank 0 carries every rank's sums; the epoch's allreduce adds them up
        totals = [0.0, 0.0, 0.0, totals[3]]
    return Position(epoch=int(state["epoch"]), step=int(state["step"]), epoch_totals=tuple(totals))
