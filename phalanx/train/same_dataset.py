"""Whether every rank holds the same map-style dataset: `ShardedLoader` and `evaluate_dataset` shard
one dataset by rank themselves, so a dataset the script already cut by rank, or split at random
per rank, trains or evaluates other examples than one device would, and nothing else would say so.

A rank's record of its dataset: its length, the identities of a few items read at fixed indices
(`identity_checksum`: labels, keys, token ids, not floating values), and a CRC of its `Subset`
indices (what `random_split` and a hand cut by rank return; it sees a split of float targets,
where labels cannot). The records are compared after one small all-gather, so every rank raises the
same UsageError (`different_datasets` writes it) naming the first rank whose record differs.
"""

from __future__ import annotations

import random
from typing import Callable

import numpy as np

import torch

from phalanx.comm.gather import gather
from phalanx.data.item_identity import identity_checksum, subset_checksum
from phalanx.errors import UsageError
from phalanx.runtime.tags import Tag
from phalanx.runtime.world import World
from phalanx.train.rng_state import rng_state, set_rng_state

PROBE_ITEMS = 8  # items whose labels/keys are compared: 8 labels of 5 balanced classes all agree by chance 3e-6


def probed_identity(read: Callable[[list[int]], list], indices: list[int]) -> tuple[int, int]:
    """`identity_checksum` of the items `read(indices)` returns, read with the same random numbers on
    every rank (a random label agrees too) and the run's own RNG states put back after."""
    saved = rng_state()
    try:
        torch.default_generator.manual_seed(0)  # the CPU generator alone: a GPU's is not in rng_state()
        np.random.seed(0)
        random.seed(0)
        return identity_checksum(read(indices))
    finally:
        set_rng_state(saved)


def dataset_record(dataset, read: Callable[[list[int]], list], indices: list[int]) -> list[int]:
    """This rank's record of `dataset`: [length, identity count, identity CRC, Subset CRC]."""
    count, checksum = probed_identity(read, indices)
    return [len(dataset) if hasattr(dataset, "__len__") else -1, count, checksum, subset_checksum(dataset)]


def different_datasets(caller: str, differ: int, first: list[int], theirs: list[int]) -> str:
    """The line for rank `differ`'s record `theirs` differing from rank 0's `first` (`dataset_record`)."""
    shards = f"{caller} shards {'each global batch' if caller == 'ShardedLoader' else 'it'} by rank itself"
    if theirs[0] == first[0] and theirs[3] != first[3]:  # Subsets of one length, of other examples
        return (f"each rank passed a different dataset to {caller} (rank {differ}'s Subset holds other indices than "
                "rank 0's): a dataset cut by rank (Subset(data, range(rank, n, k))) reads 1/k of it, and a "
                "random_split drawn from each rank's own random numbers (after torch.manual_seed(seed + rank), or "
                "unseeded) other examples on every rank; make the same split on every rank (random_split(data, "
                f"lengths, generator=torch.Generator().manual_seed(0))) and pass all of it: {shards}")
    what = (f"has {theirs[0]} examples, rank 0's {first[0]}" if theirs[0] != first[0]
            else "holds other labels or keys than rank 0's at the same indices")
    return (f"each rank passed a different dataset to {caller} (rank {differ}'s {what}): pass the whole dataset on "
            f"every rank; {shards} (a dataset cut by rank, e.g. Subset(data, range(rank, n, k)), reads 1/k of it)")


def check_same_dataset(dataset, *, world: World, caller: str, tag: Tag) -> None:
    """Raise the same UsageError on every rank unless all hold the same map-style `dataset`, read by
    indexing (its first `PROBE_ITEMS` items). A collective: every rank calls it."""
    indices = list(range(min(PROBE_ITEMS, len(dataset))))
    mine = torch.tensor([dataset_record(dataset, lambda at: [dataset[i] for i in at], indices)], dtype=torch.int64)
    every = gather(mine, world=world, tag=tag).tolist()
    differ = next((rank for rank, row in enumerate(every) if row != every[0]), None)
    if differ is not None:
        raise UsageError(different_datasets(caller, differ, every[0], every[differ]))
