"""A user's `torch.utils.data.Dataset`, read with phalanx's global-batch semantics.

`ShardedLoader(dataset, world=world, global_batch_size=64, seed=0)` gives this rank its shard of
every global batch, epoch by epoch: the epoch's order is `global_batches` (a permutation seeded
by (seed, epoch) alone, identical on every rank, so there is no `set_epoch` to forget) and the
shard is `rank_shard`'s contiguous slice, so k ranks together read exactly the batches one
device reads, the smaller last batch included. `loader.epoch(e)` yields `(batch, global_size)`:
the batch as a plain `DataLoader` collates it (any Dataset, lazy ones included, `num_workers`
as usual: one DataLoader serves every epoch, so `persistent_workers=True` keeps its workers)
and the size of the *global* batch it belongs to, which the loss needs (`phalanx.shard_loss`).
A rank whose share of a tiny last batch is empty gets an empty batch of the right structure, so
its forward/backward/gradient exchange still pair with its peers' (data/empty_batch.py).

With `micro_batches=n` a step yields a list of n micro-batches to accumulate, not one batch, each
collated on its own (there is no collated batch to cut afterwards): rank r reads the rows r, r+k,
r+2k, ... of the global batch (`accumulation_rows`), so micro-batch j over the k ranks is exactly
one device's contiguous micro-batch j. A synchronized BatchNorm then normalizes what one device
normalizes, which a rank cutting its own contiguous shard into n pieces does not.

A sampler of the user's (`sampler=`: a WeightedRandomSampler for imbalanced classes, a subset)
gives the epoch's order instead of the permutation, cut into global batches the same way; one
that draws from a `generator` gets one seeded by (seed, epoch) before each epoch, so every rank
draws the same order however its own RNG was used.

A stream (`torch.utils.data.IterableDataset`: webdataset, a Hugging Face streaming dataset, a
generator over files) has no indices to permute: its global batches are its own order, B items
at a time as `DataLoader(stream, batch_size=None, num_workers=n)` yields them, and every rank
reads the whole stream and keeps its contiguous slice of each (Accelerate's IterableDatasetShard
and Hugging Face's split_dataset_by_node read it the same way), so the stream must yield the same
items in the same order on every rank: seed its shuffle; `set_epoch(e)` is called at each epoch
where the dataset has one (`phalanx.ShardedLoader`, train/sharded_loader.py, compares the ranks'
first global batch of each epoch, and a map-style dataset's length, order and first items once).
The stream decides where an epoch ends, so such a loader has no length, and `shuffle=True` is
refused (the stream orders itself).

torch's `DistributedSampler` is DDP's way to shard, and it pads the dataset to a multiple of the
ranks by repeating examples (or drops the rest): `distributed_sampler_note` says so in one line,
for the warning DataParallel's first step gives (data_parallel/guards/first_step.py) and for a DataLoader
handed here instead of its dataset.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Sampler
from torch.utils.data._utils.collate import default_collate

from phalanx.data.empty_batch import ShardCollate, empty_batch_like
from phalanx.data.split import Ranked, epoch_seed, global_batches, rank_micro_batches, steps_per_epoch
from phalanx.errors import frame_values


def sampler_of(obj: Any) -> DistributedSampler | None:
    """`obj` itself, or the sampler of a DataLoader `obj`, when it is a DistributedSampler."""
    if isinstance(obj, DistributedSampler):
        return obj
    if isinstance(obj, DataLoader):
        for sampler in (obj.sampler, getattr(obj.batch_sampler, "sampler", None)):
            if isinstance(sampler, DistributedSampler):
                return sampler
    return None


def samplers_in_frames(frame, *, depth: int = 8) -> Iterator[tuple[str, DistributedSampler]]:
    """(name, sampler) for each DistributedSampler (or DataLoader using one) held in the locals of
    `frame` and the frames above it, `depth` frames in all, or in the script's globals, innermost
    first: where a loop that steps through a replica or an optimizer keeps its loaders (the loop is
    `frame`, or a few frames up when the step runs through train_batch or a helper)."""
    for name, value in frame_values(frame, depth=depth):
        sampler = sampler_of(value)
        if sampler is not None:
            yield name, sampler


def uneven(sampler: DistributedSampler) -> bool:
    """Whether `sampler` pads its dataset or drops some of it to give every rank an equal share."""
    try:
        return sampler.total_size != len(sampler.dataset)
    except (AttributeError, TypeError):  # a subclass that keeps no total, a dataset without a length
        return False


def distributed_sampler_note(obj: Any) -> str | None:
    """One line naming what torch's DistributedSampler (`obj`, or a DataLoader's) does to an epoch
    and the fix; None when `obj` is none, or when it neither pads nor drops (the split is then even)."""
    sampler = sampler_of(obj)
    if sampler is None or not uneven(sampler):
        return None
    num_examples, ranks = len(sampler.dataset), sampler.num_replicas
    if sampler.total_size > num_examples:
        repeats = sampler.total_size - num_examples
        what = (f"pads the {num_examples} examples to {sampler.total_size} by repeating {repeats} so that "
                f"{ranks} ranks get equal shares (as DDP does)")
    else:
        what = f"drops {num_examples - sampler.total_size} of the {num_examples} examples (drop_last=True) every epoch"
    return (f"torch's DistributedSampler {what}, so an epoch is not the 1-device epoch; use "
            "phalanx.ShardedLoader(dataset, world=world, global_batch_size=..., shuffle=True), which splits every "
            "global batch exactly, the last one unevenly")


def refuse_loader(obj: Any, what: str) -> None:
    """ValueError when a DataLoader is handed where a Dataset belongs (`what`: who refuses)."""
    if isinstance(obj, DataLoader):
        sampler = " (with torch's DistributedSampler, which phalanx's sharding replaces)" if sampler_of(obj) else ""
        raise ValueError(f"{what} takes a Dataset, got a DataLoader{sampler}; pass loader.dataset "
                         "(ShardedLoader's global_batch_size is the batch of all ranks: DDP's batch_size x world size)")


class ShardedLoader:
    """This rank's shards of a dataset's global batches; see the module docstring."""

    def __init__(self, dataset: Dataset, *, world: Ranked, global_batch_size: int, seed: int = 0,
                 shuffle: bool | None = None, sampler: Sampler | None = None, collate_fn: Callable | None = None,
                 num_workers: int = 0, drop_last: bool = False, micro_batches: int | None = None,
                 **loader_kwargs: Any) -> None:
        """`loader_kwargs` go to each epoch's `DataLoader` (pin_memory, ...); batching is this
        class's, so `batch_size` and `batch_sampler` are refused. `drop_last=True` leaves out each
        epoch's last global batch when it is smaller than the others (a BatchNorm model's batch of
        one; the examples it holds sit elsewhere in the next epoch's order); default: it is trained,
        split over the ranks as unevenly as it must be, exactly as 1 device trains it (`shuffle`, as
        DataLoader's: False keeps the dataset's order, every epoch the same; None: True, but a
        stream's own order for an IterableDataset). `sampler` (a WeightedRandomSampler, ...): its
        order each epoch, cut into global batches; one that draws from a `generator` is given one
        seeded by (seed, epoch), so every rank draws the same order, and one with `set_epoch` is told
        the epoch. `micro_batches=n`: each step yields a list of n micro-batches to accumulate (n = 1 too),
        piece j over all ranks one device's contiguous micro-batch j (`rank_micro_batches`; fewer
        where a global batch holds fewer than n examples), so a BatchNorm model accumulating on k
        ranks normalizes what one device does."""
        refuse_loader(dataset, "ShardedLoader")
        taken = sorted({"batch_size", "batch_sampler"} & set(loader_kwargs))
        if taken:
            per_rank = (" (global_batch_size is the batch of all ranks together; DDP's batch_size is per rank: "
                        "global = batch_size x world size)" if "batch_size" in taken else "")
            raise ValueError(f"ShardedLoader decides {', '.join(taken)} itself (global_batch_size, seed, shuffle); "
                             f"drop those arguments{per_rank}")
        if global_batch_size < world.world_size:
            raise ValueError(f"global_batch_size {global_batch_size} is smaller than the {world.world_size} ranks; "
                             f"use {world.world_size} or more")
        if seed < 0:
            raise ValueError(f"seed {seed} must be >= 0")
        if micro_batches is not None and (not isinstance(micro_batches, int) or isinstance(micro_batches, bool)
                                          or not 1 <= micro_batches <= global_batch_size):
            raise ValueError(f"micro_batches={micro_batches!r} must be a whole number from 1 (no accumulation) to "
                             f"global_batch_size ({global_batch_size}): the micro-batches each step is cut into")
        self.streams = isinstance(dataset, IterableDataset)
        if self.streams and drop_last:
            raise ValueError("ShardedLoader reads an IterableDataset to its end, as every rank must; drop "
                             "drop_last=True and skip a small last batch in the loop (its global size is given)")
        if self.streams and shuffle:
            raise ValueError("ShardedLoader reads an IterableDataset in its own order, as every rank must read it; "
                             "drop shuffle=True and shuffle inside the stream with a fixed seed (set_epoch(e) is "
                             "called every epoch where the dataset has one)")
        if sampler is not None:
            if self.streams or shuffle or sampler_of(sampler) is not None:
                why = ("a stream orders itself" if self.streams else "the order is the sampler's, which shuffle=True "
                       "would override" if shuffle else "torch's DistributedSampler shards by itself, padding or "
                       "dropping examples")
                raise ValueError(f"ShardedLoader cannot take this sampler: {why}; drop "
                                 f"{'shuffle=True' if shuffle and not self.streams else 'the sampler'}")
        self.sampler = sampler
        self.num_examples = None if self.streams else len(sampler if sampler is not None else dataset)
        if self.num_examples == 0:
            raise ValueError("the dataset has 0 examples; nothing to train on")
        if drop_last and self.num_examples < global_batch_size:
            raise ValueError(f"drop_last=True leaves nothing of {self.num_examples} examples in global batches of "
                             f"{global_batch_size}; use a smaller global_batch_size or drop_last=False")
        self.drop_last = drop_last
        self.dataset, self.world = dataset, world
        self.global_batch_size, self.seed, self.micro_batches = global_batch_size, seed, micro_batches
        self.shuffle = not self.streams and shuffle is not False  # a stream orders itself
        # Worker base seeds from (seed, epoch), not torch's RNG: a resumed epoch leaves dropout's draws as they were.
        self._generator = torch.Generator()
        self.num_workers, self.loader_kwargs = num_workers, {"generator": self._generator, **loader_kwargs}
        self.collate_fn = collate_fn or default_collate
        self.collate = None if self.streams else ShardCollate(dataset, self.collate_fn)
        self._shards, self._loader = _EpochShards(), None

    def __len__(self) -> int:
        """Steps per epoch (the last, smaller global batch counts)."""
        if self.streams:
            raise TypeError("a ShardedLoader over an IterableDataset has no length: the stream decides where an epoch "
                            "ends (count the steps of loader.epoch(e) as they come)")
        if self.drop_last:
            return self.num_examples // self.global_batch_size
        return steps_per_epoch(self.num_examples, self.global_batch_size)

    def __iter__(self):
        """Refused in one line: Fabric's and DDP's loop iterates the loader itself; this one an epoch at a time."""
        raise TypeError("a ShardedLoader is read an epoch at a time: for batch, global_size in loader.epoch(epoch): "
                        "... (the order is a permutation of (seed, epoch); the batch is this rank's share of it)")

    def epoch(self, epoch: int) -> Iterator[tuple[Any, int]]:
        """Yield (this rank's batch, global batch size) for every step of `epoch`."""
        self._generator.manual_seed(epoch_seed(self.seed, epoch))
        if self.streams:
            yield from self._stream_epoch(epoch)
            return
        if self.sampler is None:
            batches = global_batches(self.num_examples, self.global_batch_size, seed=self.seed, epoch=epoch,
                                     shuffle=self.shuffle)
        else:
            batches = list(torch.split(self._sampler_order(epoch), self.global_batch_size))
        if self.drop_last and batches[-1].numel() < self.global_batch_size:
            batches = batches[:-1]
        self._order_made(epoch, batches)
        cuts = [rank_micro_batches(b, rank=self.world.rank, world_size=self.world.world_size,
                                   micro_batches=self.micro_batches or 1) for b in batches]
        self._shards.now = [piece.tolist() for pieces in cuts for piece in pieces]  # one DataLoader batch each
        if self._loader is None:  # one DataLoader for every epoch: persistent_workers=True keeps its workers
            self._loader = DataLoader(self.dataset, batch_sampler=self._shards, collate_fn=self.collate,
                                      num_workers=self.num_workers, **self.loader_kwargs)
        loaded = iter(self._loader)
        for pieces, indices in zip(cuts, batches):
            micro = [next(loaded) for _ in pieces]
            yield micro if self.micro_batches is not None else micro[0], indices.numel()

    def _sampler_order(self, epoch: int) -> torch.Tensor:
        """The user's sampler's order for `epoch`, the same on every rank where its draws are seeded
        here (a `generator`) or by its `set_epoch`; its length is checked, as DataLoader trusts it."""
        if hasattr(self.sampler, "generator"):  # RandomSampler, WeightedRandomSampler, SubsetRandomSampler
            self.sampler.generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        order = torch.as_tensor(list(iter(self.sampler)), dtype=torch.int64)
        if order.numel() != self.num_examples:
            raise ValueError(f"the sampler gave {order.numel()} indices in epoch {epoch}, but its len() is "
                             f"{self.num_examples}; make its __len__ match what it yields")
        return order

    def _order_made(self, epoch: int, batches: list[torch.Tensor]) -> None:
        """Called with a map-style epoch's global batches (indices), before anything is loaded;
        nothing here (phalanx.ShardedLoader compares the ranks' first: train/sharded_loader.py)."""

    def _stream_epoch(self, epoch: int) -> Iterator[tuple[Any, int]]:
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        yield from stream_shards(self.dataset, self.global_batch_size, world=self.world, collate_fn=self.collate_fn,
                                 num_workers=self.num_workers, micro_batches=self.micro_batches,
                                 each_chunk=lambda index, items, last:
                                 self._chunk_read(epoch, index, items, last), **self.loader_kwargs)

    def _chunk_read(self, epoch: int, index: int, items: list, last: bool) -> None:
        """Called with the items of a stream's global batch `index` of `epoch` (`last`: the stream
        ends with it), before any rank trains on it; nothing here (phalanx.ShardedLoader compares
        the ranks' batch sizes and first items: train/sharded_loader.py)."""


class _EpochShards:
    """The batch sampler of a ShardedLoader's one DataLoader: this rank's shards of the epoch that
    `epoch()` set last, read each time the DataLoader starts an epoch (its workers, persistent or
    not, only ever see indices)."""

    def __init__(self) -> None:
        self.now: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.now)

    def __len__(self) -> int:
        return len(self.now)


def stream_shards(stream: IterableDataset, chunk: int, *, world: Ranked, collate_fn: Callable = default_collate,
                  num_workers: int = 0, micro_batches: int | None = None,
                  each_chunk: Callable[[int, list, bool], None] | None = None, **loader_kwargs: Any
                  ) -> Iterator[tuple[Any, int]]:
    """A stream's items in order, `chunk` at a time (the last chunk what is left): this rank's
    contiguous slice of each, collated (or its `micro_batches` pieces, a list), and the chunk's
    size. Every rank reads every item; an empty slice is the chunk's first item collated and cut to
    0 rows. `each_chunk(index, items, last)` sees each chunk before anything of it is yielded, an
    empty stream's as `[]`, and whether the stream ends with it (one item is read ahead to know)."""
    items = iter(DataLoader(stream, batch_size=None, collate_fn=as_is, num_workers=num_workers, **loader_kwargs))
    batch, end = list(itertools.islice(items, chunk)), object()
    for index in itertools.count():
        ahead = next(items, end) if len(batch) == chunk else end
        if each_chunk is not None:
            each_chunk(index, batch, ahead is end)
        if not batch:
            return
        pieces = rank_micro_batches(batch, rank=world.rank, world_size=world.world_size,
                                    micro_batches=micro_batches or 1)
        mine = [collate_fn(piece) if piece else empty_batch_like(collate_fn(batch[:1])) for piece in pieces]
        yield mine if micro_batches is not None else mine[0], len(batch)
        if ahead is end:
            return
        batch = [ahead, *itertools.islice(items, chunk - 1)]


def as_is(item: Any) -> Any:
    """An item as the dataset yields it (DataLoader's collate for batch_size=None would convert
    it); module-level, so loader workers can pickle it."""
    return item
