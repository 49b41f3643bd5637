"""Where a `phalanx.ShardedLoader` stands inside an epoch, as checkpoint data: what makes a
mid-epoch resume exact when the dataset draws random numbers (`torch.rand` in `__getitem__`, as
torchvision's random transforms do).

Skipping the steps already done is not enough for such data: loading the skipped batches again in
this process (`num_workers=0`) draws from the RNG states that resume restored, not from the
epoch's start. (Loader workers' seeds come from a generator seeded by (seed, epoch), not from the
process's RNG, so they and the step's own draws resume alike without `loader=`; a resume
without it is one warning on rank 0 all the same.) So the loader keeps this rank's RNG states as
they were when its last epoch began (`EpochStart`); `phalanx.checkpoint(..., loader=loader)` saves
every rank's beside its current ones, and `phalanx.resume(..., loader=loader)` hands them back as
a `Replay`: the resumed epoch starts from the epoch's states, makes its iterator (the same worker
seeds), loads the skipped batches as the first run did (the same draws in this process and in
every worker) and yields them, so the loop's `continue` for `step < start.step` stays, then puts
back the checkpoint's states before the first batch not yet trained on. Exact on the device count
and `num_workers` that saved the checkpoint; on others each process loads other items, so their
draws cannot repeat (augmentation seeded by (epoch, index) is the same on any).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from phalanx.errors import warn_at_caller
from phalanx.train.rng_state import set_rng_state


@dataclass(frozen=True, kw_only=True)
class EpochStart:
    """This rank's RNG states (`rng_state()`'s) when the loader began `epoch`."""

    epoch: int
    rng: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class Replay:
    """A resumed epoch: `step` steps of `epoch` are done; `epoch_rng` are this rank's states at the
    epoch's start, `rng` its states at the checkpoint."""

    epoch: int
    step: int
    epoch_rng: dict[str, Any]
    rng: dict[str, Any]


def replayed(batches: Iterator, replay: Replay) -> Iterator:
    """`batches` (made after `replay.epoch_rng` was put back), the first `replay.step` as they
    come, then - before the next is loaded - the checkpoint's RNG states, then the rest."""
    for _ in range(replay.step):
        batch = next(batches, None)
        if batch is None:
            return
        yield batch
    set_rng_state(replay.rng)
    yield from batches


def loader_record(loader) -> dict[str, Any] | None:
    """This rank's part of a checkpoint: the epoch its `loader` began last and its RNG states
    then (None without a loader, or before its first epoch)."""
    start = None if loader is None else loader.epoch_start()
    return None if start is None else {"epoch": start.epoch, "rng": start.rng}


def of_rank(rows: list, rank: int) -> Any:
    """Rank `rank`'s entry of a checkpoint's per-rank list; rank 0's when the saving run had fewer
    ranks (a resume on more devices)."""
    return rows[rank] if rank < len(rows) else rows[0]


def hand_to_loader(state: dict, *, loader, rank: int, is_main: bool, path: Any) -> None:
    """After a checkpoint is restored: give `loader` the replay of its mid-epoch position. Rank 0
    warns when the checkpoint has epoch-start states but no loader was passed, or the other way."""
    step, epoch, records = int(state["step"]), int(state["epoch"]), state.get("loader") or []
    if step == 0:  # an epoch's boundary: the restored states are the next epoch's start
        return
    mine = of_rank(records, rank) if records else None
    if loader is None:
        if is_main:
            saved = f"was saved with loader= at step {step}" if mine is not None else f"is at step {step}"
            warn_at_caller(f"resuming without loader=: checkpoint {path} {saved} of epoch {epoch}, and the skipped "
                           "batches load again from its RNG states, so random draws made while loading them in this "
                           "process (augmentation in __getitem__ with num_workers=0, a collate that draws) differ "
                           "from the uninterrupted run's; pass loader=loader to phalanx.resume too (and to "
                           "phalanx.checkpoint): plain data, dropout and loader workers' draws go on exactly "
                           "either way")
        return
    if mine is None or int(mine["epoch"]) != epoch:
        if is_main:
            warn_at_caller(f"checkpoint {path} is at step {step} of epoch {epoch} and holds no RNG states of that "
                           "epoch's start (saved without loader=): the loader cannot replay the skipped batches' "
                           "random draws; pass loader=loader to phalanx.checkpoint")
        return
    loader.replay_from(Replay(epoch=epoch, step=step, epoch_rng=mine["rng"], rng=of_rank(state["rng"], rank)))
