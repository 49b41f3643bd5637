"""Sharded checkpoints: every rank writes its own share, rank 0 a manifest saying what a whole one is.

A replica built with `shard=` holds 1/k of the parameters' values (stage 3) and of the optimizer
state, so no rank can write a whole checkpoint without gathering it. Instead each rank writes its
share (data_parallel/sharding/state.py: its ranges of the one flat order, with values, optimizer
state and scalars) to `checkpoint.shard-<r>-of-<k>.<serial>.pt`, atomically; once every rank has
written, rank 0 writes the manifest `checkpoint.pt` - position, fingerprint, RNG states, the
epoch's sums, the model's buffers, the flat layout, each share's file and ranges, the optimizer's
name and groups - through the same two-generation write as a whole checkpoint (checkpoint_files.py).
The manifest's atomic rename is the commit: a kill before it leaves the previous manifest and
the files it names; files no manifest names are removed after the next commit.

Each share is bound to its generation: it holds the generation's serial and position (epoch,
step), and the manifest records each share's SHA-256 (hashed from the bytes in memory as they are
written). Reading checks the manifest and the digest of every file it names before anything is
applied, so a share that is missing, damaged or another generation's (an intact older share
copied over this one's name, as a sync tool that renames files can leave) makes the generation
unusable: `--resume auto` goes back to the previous one and says why, and a checkpoint named on
its own is refused in one line naming the share. Going back, rather than refusing a directory,
because the generation before it is whole and resuming from it ends exactly where an
uninterrupted run does (only the steps since it are trained again). Manifests written before
the digests still have every share's CRCs checked.
A sharded checkpoint loads into any k (each rank reads only the ranges it owns, memory-mapped),
into `shard="none"`, one device or a model split (`whole_state` assembles the whole), and a whole
checkpoint loads into a sharded replica (`WholeReader`): `restore_any` picks the path.

Why not torch.distributed.checkpoint (DCP): its resharding plans DTensor's placements, whose
`Shard(0)` cuts a tensor as torch.chunk does (ceil-sized, last shards short or empty), not the
even cut of one flat order this layout uses; its files are not CRC-checked or kept two
generations deep as phalanx's are; and reading one back into a single process needs its own
conversion step. The ranges here are plain torch.save files any process can read.
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
import zipfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from phalanx.comm import Tag, agreed_outcome, collective
from phalanx.data_parallel.sharding.flat_layout import Slot
from phalanx.data_parallel.sharding.state import RangesReader, WholeReader, load_shard, rank_state, trainable_names, \
    whole_state
from phalanx.atomic import atomic_write_bytes, make_dir
from phalanx.errors import UsageError
from phalanx.runtime.world import World
from phalanx.train.checkpoint_files import DamagedFile, previous_of, serialize, write_generation
from phalanx.train.streamed_save import persistent_buffers

FORMAT_SHARDED = "phalanx-checkpoint-sharded-1"


def shard_name(rank: int, world_size: int, serial: str) -> str:
    return f"checkpoint.shard-{rank:05d}-of-{world_size:05d}.{serial}.pt"


def save_sharded(manifest_path: Path, *, world: World, dp, optimizer: torch.optim.Optimizer, run_state: dict,
                 every: list[dict]) -> Path | None:
    """Every rank calls this after gathering `every` rank's RNG states and sums (`run_state` is
    the rest of the manifest: format, position, fingerprint, settings). Returns the manifest on
    rank 0."""
    serial = [secrets.token_hex(4) if world.is_main else None]
    with collective(world, Tag("checkpoint")):
        dist.broadcast_object_list(serial, src=0)
    share = {**rank_state(dp, optimizer), "generation": {"serial": serial[0], "epoch": run_state["epoch"],
                                                         "step": run_state["step"]}}
    name = shard_name(world.rank, world.world_size, serial[0])
    data = serialize(share)
    # Every rank's share on disk before rank 0's manifest names them. Where any rank's write fails
    # (or rank 0's manifest's), every rank raises it and removes its own share of this save.
    def remove_mine() -> None:
        with contextlib.suppress(OSError):
            (manifest_path.parent / name).unlink(missing_ok=True)

    with agreed_outcome(world, Tag("checkpoint"), undo=remove_mine):
        make_dir(manifest_path.parent, named="the checkpoint's location")
        atomic_write_bytes(manifest_path.parent / name, data)
    written = [None] * world.world_size
    with collective(world, Tag("checkpoint")):
        dist.all_gather_object(written, {"file": name, "ranges": share["ranges"],
                                         "sha256": hashlib.sha256(data).hexdigest()})
    with agreed_outcome(world, Tag("checkpoint"), undo=remove_mine):
        if world.is_main:
            _write_manifest(manifest_path, dp=dp, run_state=run_state, share=share, written=written, every=every)
    if world.is_main:  # an older save's shares; left for the next save where they cannot be removed now
        with contextlib.suppress(OSError):
            _remove_unnamed_shares(manifest_path)
    return manifest_path if world.is_main else None


def _write_manifest(manifest_path: Path, *, dp, run_state: dict, share: dict, written: list[dict],
                    every: list[dict]) -> None:
    manifest = {**run_state, "format": FORMAT_SHARDED,
                "model": {**persistent_buffers(dp.module), **frozen_parameters(dp.module, dp.sharding.layout.slots)},
                "layout": dp.sharding.layout.describe(), "shards": written, "optimizer_groups": share["groups"],
                "rng": [r["rng"] for r in every]}
    write_generation(manifest_path, serialize(manifest))


def frozen_parameters(module: torch.nn.Module, slots) -> dict[str, torch.Tensor]:
    """`module`'s parameters that no slot of the flat layout holds (requires_grad=False: no bucket,
    whole on every rank at every stage), by state-dict key: the manifest keeps them beside the
    buffers, so a whole model read from a sharded checkpoint is the saved one."""
    trained = {slot.name for slot in slots}
    return {name: param.detach().cpu().clone() for name, param in module.named_parameters() if name not in trained}


def share_files(directory: Path) -> list[Path]:
    """Every share file in a checkpoint directory (any generation's, or one no manifest names)."""
    return sorted(directory.glob("checkpoint.shard-*.pt")) if directory.is_dir() else []


def _remove_unnamed_shares(manifest_path: Path) -> None:
    """Delete share files that neither generation's manifest names (an older save's, or one a
    kill left before its manifest)."""
    named = set()
    for path in (manifest_path, previous_of(manifest_path)):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # noqa: BLE001 - a missing or unreadable generation names nothing
            continue
        if isinstance(state, dict) and state.get("format") == FORMAT_SHARDED:
            named.update(s["file"] for s in state["shards"])
    for candidate in share_files(manifest_path.parent):
        if candidate.name not in named:
            candidate.unlink(missing_ok=True)


def check_shares(manifest_path: Path, state: dict) -> None:
    """DamagedFile unless every share the manifest names is there and is the one this generation
    wrote (its SHA-256; a manifest without digests: the CRCs of every record)."""
    for rank, share in enumerate(state["shards"]):
        path = manifest_path.parent / share["file"]
        if not path.is_file():
            raise DamagedFile(manifest_path, f"names rank {rank}'s share {path.name}, which is missing")
        if "sha256" in share and _sha256(path) == share["sha256"]:
            continue  # the very bytes written (their CRCs were right then)
        _check_crcs(manifest_path, rank, path)
        if "sha256" in share:  # intact, yet not the share this generation wrote
            raise DamagedFile(manifest_path, f"names rank {rank}'s share {path.name}, which holds "
                                             f"{_generation_of(path)}, not this one's (saved at "
                                             f"{_position(state['epoch'], state['step'])}): its SHA-256 differs "
                                             "from the manifest's (a share copied over another's name?)")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _check_crcs(manifest_path: Path, rank: int, path: Path) -> None:
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError) as exc:
        raise DamagedFile(manifest_path, f"names rank {rank}'s share {path.name}, which is damaged ({exc})") from None
    if bad is not None:
        raise DamagedFile(manifest_path, f"names rank {rank}'s share {path.name}, whose record {bad} fails its "
                                         "CRC-32 check")


def _generation_of(path: Path) -> str:
    """Which generation a share says it belongs to, in words."""
    try:
        generation = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("generation")
    except Exception:  # noqa: BLE001 - a file that is no share at all
        generation = None
    if not isinstance(generation, dict):
        return "another generation's share (one from before shares named their generation)"
    return f"the share of another generation (saved at {_position(generation.get('epoch'), generation.get('step'))})"


def _position(epoch: int, step: int) -> str:
    """A saved position in words: the end of epoch E, or epoch E+1 at step S (epoch counts those done)."""
    return f"the end of epoch {epoch}" if step == 0 else f"epoch {epoch + 1}, step {step}"


def reader_of(manifest_path: str | Path, state: dict) -> RangesReader:
    """A `Reader` of a sharded checkpoint: its manifest `state` read from `manifest_path`."""
    manifest_path = Path(manifest_path)
    shares = state["shards"]
    load = lambda i: torch.load(manifest_path.parent / shares[i]["file"], map_location="cpu",  # noqa: E731
                                weights_only=True, mmap=True)
    return RangesReader([[tuple(r) for r in s["ranges"]] for s in shares], load, state["optimizer_groups"])


def restore_any(state: dict, *, path: Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                dp=None) -> None:
    """Put a checked checkpoint's model and optimizer state into this rank's replica: a sharded
    replica `dp` (with `module` its model and `optimizer` its `dp.optimizer(...)`), or a whole
    `module` and its plain optimizer. Whole or sharded checkpoints alike, at any k."""
    sharded_target = dp is not None and dp.sharding is not None
    if state.get("format") == FORMAT_SHARDED:
        reader = reader_of(path, state)
        if sharded_target:
            load_shard(dp, optimizer, reader)
            module.load_state_dict(state["model"], strict=False)
            return
        slots = [Slot.of(record) for record in state["layout"]]
        group_names = optimizer_names(module, optimizer)  # with its frozen parameters, which torch's groups keep
        params, optimizer_state = whole_state(reader, slots=slots, names=[n for group in group_names for n in group],
                                              group_names=group_names)
        whole = {**state["model"], **params}
        whole.update({alias: whole[name] for alias, name in tied_aliases(module).items() if name in whole})
        _refuse_without_frozen(module, whole, path)
        module.load_state_dict(whole)
        optimizer.load_state_dict(optimizer_state)
        return
    if sharded_target:
        reader = WholeReader(state["model"], state["optimizer"], names=whole_optimizer_order(state, module),
                             slots=dp.sharding.layout.slots)
        load_shard(dp, optimizer, reader)
        names = {slot.name for slot in dp.sharding.layout.slots}
        aliases = tied_aliases(module)  # a tied weight's other names: its slot holds it already
        module.load_state_dict({k: v for k, v in state["model"].items()
                                if k not in names and aliases.get(k) not in names}, strict=False)
        return
    module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def _refuse_without_frozen(module: torch.nn.Module, whole: dict, path: Path) -> None:
    """A sharded checkpoint saved before its manifest kept the frozen parameters gives a whole
    model no value for them: one line saying so, where torch's strict load would list keys."""
    missing = [name for name, _ in module.named_parameters() if name not in whole]
    if missing:
        shown = ", ".join(missing[:4]) + (" ..." if len(missing) > 4 else "")
        raise UsageError(f"sharded checkpoint {path} holds no {shown}: frozen parameters (requires_grad=False), "
                         "which sharded checkpoints written before they were kept left out; resume it with shard= "
                         "(the frozen weights are then the model's own, as built), save, and resume that")


def optimizer_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str | None]]:
    """Each param group's parameter names in the order the optimizer holds them, which is how a
    whole optimizer's state_dict numbers its state: saved beside it, so a sharded run reads that
    state by name (None: a parameter the model does not hold)."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    return [[name_of.get(id(p)) for p in group["params"]] for group in optimizer.param_groups]


def whole_optimizer_order(state: dict, module: torch.nn.Module) -> list[str | None]:
    """The parameter name behind each index of a whole checkpoint's optimizer state: as saved
    (`optimizer_names`), or where those are not all known (saved before they were kept), the module's order,
    which is right only for one group over all its parameters (ValueError for any other)."""
    saved = [name for group in state.get("optimizer_names") or [] for name in group]
    if saved and None not in saved:  # (a split's optimizer may hold copies the saved model does not name)
        return saved
    groups, names = state["optimizer"].get("param_groups", []), trainable_names(module)
    if len(groups) <= 1 and sum(len(g["params"]) for g in groups) == len(names):
        return names
    raise ValueError(f"its {len(groups)} param groups were saved before phalanx kept their parameters' names, so "
                     "a sharded run cannot tell which state is whose; resume it with shard=\"none\", save again, "
                     "then resume that with shard=")


def tied_aliases(module: torch.nn.Module) -> dict[str, str]:
    """A tied parameter's other names (`head.weight` = `embedding.weight`) -> the name
    `named_parameters()` gives it, which the flat layout and sharded checkpoints use."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def optimizer_groups(state: dict) -> list[dict[str, Any]]:
    """The saved optimizer's param groups (hyperparameters) of a whole or sharded checkpoint."""
    if state.get("format") == FORMAT_SHARDED:
        return state["optimizer_groups"]
    return state["optimizer"].get("param_groups", [])
