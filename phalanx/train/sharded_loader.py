"""`phalanx.ShardedLoader`: data/loader.py's, plus the checks that every rank reads the same data,
and the replay that makes a mid-epoch resume exact (train/loader_resume.py).

Over a stream (an `IterableDataset`), every rank reads the whole stream and keeps its slice of
each global batch, so the global batch is one device's only if every rank's stream yields the same
items in the same order. A stream shuffled without a fixed seed (Hugging Face's
`IterableDataset.shuffle()` without one draws a seed in each process; Accelerate hides this by
reading the stream on rank 0 alone and sending the batches out) gives each rank other items: some
of the data is trained on twice in an epoch and some never, silently. So at the first global batch
of every epoch, before anything is trained on it, the ranks all-gather one small record of its
items' identities (`identity_checksum`: strings, bytes, whole numbers, token ids; not floating
values, which a per-rank random augmentation may change) and rank 0 warns, once, naming the first
rank whose items differ and the fix. One gather of 3 numbers an epoch. A stream that yields fewer
items on one rank (split by rank, a file missing on one host) would have the ranks train last
batches of different sizes, or one rank a batch alone, so every global batch's size on each rank,
and whether it ends that rank's stream (one item read ahead), is compared before it is yielded,
one allreduce of 2 x k numbers a batch: a difference stops every rank with the same UsageError.

A map-style dataset's order is computed alike on every rank, unless the script made it differ: a
dataset already cut by rank (Horovod's habit: `Subset(full, range(rank, n, k))`, files split by
rank) trains on 1/k of the data, a `random_split` drawn after a per-rank seed
(`torch.manual_seed(seed + rank)`, for augmentation) gives each rank other examples, and a sampler
drawing from unseeded numpy or Python RNG orders each rank's epoch differently. So at the loader's
first epoch the ranks gather, once, the dataset's length, a CRC of the epoch's whole index order,
one of its Subsets' indices (which sees a split of float targets, where labels cannot) and the
identities of the first global batch's first `PROBE_ITEMS` items (read where the loader reads, with
the RNG states set aside and put back, so the run's draws are untouched: 8 reads once on each
rank, outside its own shards).
Any difference is certain, so every rank raises the same UsageError naming the cause and the fix
before a step is trained. Neither check runs in a world of one, nor for a stand-in for the world
that opened no process group (tests).
"""

from __future__ import annotations

import functools
import weakref
import zlib

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from phalanx.comm.calls import native
from phalanx.comm.gather import gather
from phalanx.data.item_identity import identity_checksum
from phalanx.data.loader import ShardedLoader as LocalShardedLoader, as_is
from phalanx.errors import UsageError, warn_at_caller
from phalanx.runtime.call_habits import phalanx_call
from phalanx.runtime.tags import Tag
from phalanx.runtime.world import World
from phalanx.train.loader_resume import EpochStart, Replay, replayed
from phalanx.train.rng_state import rng_state, set_rng_state
from phalanx.train.same_dataset import PROBE_ITEMS, dataset_record, different_datasets

STREAM_SIZES = Tag("stream batch sizes")  # each global batch of a stream: its size per rank, and if it ends it


# The loaders of this process inside an epoch: a mid-epoch phalanx.checkpoint without loader=
# names what it leaves out (script_checkpoint.py).
IN_EPOCH: "weakref.WeakSet[ShardedLoader]" = weakref.WeakSet()
_EPOCH_WAY = "for batch, global_size in loader.epoch(epoch): ..."
_NOT_HERE = {  # DataLoader's and DistributedSampler's attributes -> phalanx's way
    "set_epoch": f"DistributedSampler's set_epoch is loader.epoch's argument: {_EPOCH_WAY} draws that epoch's order "
                 "on every rank",
    "batch_size": "it holds global_batch_size, the batch of all ranks together; each step yields this rank's share "
                  f"and the global size: {_EPOCH_WAY}",
}


class ShardedLoader(LocalShardedLoader):
    __doc__ = LocalShardedLoader.__doc__

    _said = False  # whether this loader warned already: once is enough
    _checked = False  # whether the ranks' map-style data were compared (the first epoch)
    _started: EpochStart | None = None
    _replay: Replay | None = None

    # wraps: help() and inspect.signature show data/loader.py's keywords (global_batch_size, seed,
    # shuffle, ...) that the docs name, not a bare **kwargs.
    @phalanx_call  # the World by position: one line (call_habits.py)
    @functools.wraps(LocalShardedLoader.__init__)
    def __init__(self, dataset, *, world, **kwargs) -> None:
        if "global_batch_size" not in kwargs and "batch_size" in kwargs:  # DataLoader's, per rank under DDP
            per_rank = kwargs["batch_size"]
            example = (f": batch_size={per_rank} on {world.world_size} ranks is global_batch_size="
                       f"{per_rank * world.world_size}" if isinstance(per_rank, int) else "")
            raise TypeError("ShardedLoader takes global_batch_size=, the batch of all ranks together, not batch_size= "
                            f"(DataLoader's, per rank under a DistributedSampler){example}")
        if isinstance(world, World):  # tests hand data/loader.py stand-ins for the world
            world.check_here("phalanx.ShardedLoader")
        super().__init__(dataset, world=world, **kwargs)

    def __getattr__(self, name: str):
        """DataLoader's and DistributedSampler's names a DDP loop asks of its loader, named in one line."""
        if name in _NOT_HERE:
            raise AttributeError(f"'ShardedLoader' object has no attribute {name!r}: {_NOT_HERE[name]}")
        raise AttributeError(f"'ShardedLoader' object has no attribute {name!r}")

    def epoch(self, epoch: int):
        """Yield (this rank's batch, global batch size) for every step of `epoch`; the epoch that
        `phalanx.resume(..., loader=self)` stopped in replays its done steps' random draws."""
        replay = self._replay if self._replay is not None and self._replay.epoch == epoch else None
        if replay is not None:
            self._replay = None
            set_rng_state(replay.epoch_rng)
        self._started = EpochStart(epoch=epoch, rng=rng_state())  # before the sampler or the iterator draws
        batches = super().epoch(epoch)
        IN_EPOCH.add(self)
        try:
            yield from (batches if replay is None else replayed(batches, replay))
        finally:
            IN_EPOCH.discard(self)

    def epoch_start(self) -> EpochStart | None:
        """This rank's RNG states when its last epoch began (for `phalanx.checkpoint(..., loader=)`)."""
        return self._started

    def replay_from(self, replay: Replay) -> None:
        """Have epoch `replay.epoch` replay its first `replay.step` steps' draws (`phalanx.resume`)."""
        self._replay = replay

    def _compares(self) -> bool:
        world = self.world
        return isinstance(world, World) and world.distributed and dist.is_initialized()

    def _order_made(self, epoch: int, batches: list[torch.Tensor]) -> None:
        """Compare the ranks' map-style data once (module docstring)."""
        if self._checked or not self._compares():
            return
        self._checked = True
        order = torch.cat(batches).to(torch.int64).contiguous().numpy().tobytes()
        size, count, checksum, subset = dataset_record(self.dataset, self._read, batches[0][:PROBE_ITEMS].tolist())
        mine = torch.tensor([[size, count, checksum, subset, zlib.crc32(order)]], dtype=torch.int64)
        every = gather(mine, world=self.world).tolist()
        differ = next((rank for rank, row in enumerate(every) if row != every[0]), None)
        if differ is None:
            return
        theirs, first = every[differ], every[0]
        if theirs[4] == first[4] or theirs[0] != first[0] or theirs[3] != first[3]:  # else the order alone differs
            raise UsageError(different_datasets("ShardedLoader", differ, first[:4], theirs[:4]))
        raise UsageError(f"the sampler gives rank {differ} another order than rank 0 in epoch {epoch}, so the ranks "
                         "cut other global batches than one device reads: make every rank draw the same order (draw "
                         "from self.generator, which ShardedLoader seeds by (seed, epoch), not from unseeded numpy "
                         "or Python random numbers)")

    def _read(self, indices: list[int]) -> list:
        """The items at `indices`, read where this loader reads its batches: here, or with loader
        workers in one worker of the same settings (a dataset that opens its files or database at
        its first read, as HDF5 and LMDB need, must not open them in the process workers fork from)."""
        if not self.num_workers:
            return [self.dataset[i] for i in indices]
        settings = {key: value for key, value in self.loader_kwargs.items()
                    if key in ("worker_init_fn", "multiprocessing_context", "timeout")}
        return list(DataLoader(self.dataset, batch_size=None, sampler=indices, num_workers=1, collate_fn=as_is,
                               **settings))

    def _chunk_read(self, epoch: int, index: int, items: list, last: bool) -> None:
        """Compare the ranks' sizes of the stream's global batch `index` and whether it is their
        last (every batch), then its first batch's items (module docstring)."""
        if not self._compares():
            return
        table = torch.zeros(self.world.world_size, 2, dtype=torch.int64, device=self.world.device)
        table[self.world.rank] = torch.tensor([len(items), int(last)])
        native(self.world, STREAM_SIZES, lambda: dist.all_reduce(table, async_op=True), size_bytes=table.numel() * 8)
        every = table.tolist()
        differ = next((rank for rank, row in enumerate(every) if row != every[0]), None)
        if differ is not None:
            def said(rank):
                size, ends = every[rank]
                return f"rank {rank}'s holds {size} item(s){' and ends its stream' if ends else ', more follow'}"
            raise UsageError(f"the stream's global batch {index} of epoch {epoch} differs between ranks ({said(0)}, "
                             f"{said(differ)}): every rank must read the same items, as many of them, in the same "
                             "order, or the ranks train on other batches than one device reads (or wait for each "
                             "other); make the stream yield the same items on every rank (not split by rank: "
                             "ShardedLoader splits each global batch itself)")
        if index == 0 and items:
            self._first_batch(epoch, items)

    def _first_batch(self, epoch: int, items: list) -> None:
        """Compare the ranks' first global batch of `epoch` (module docstring)."""
        count, checksum = identity_checksum(items)
        mine = torch.tensor([[len(items), count, checksum]], dtype=torch.int64)
        every = gather(mine, world=self.world).tolist()
        differ = next((rank for rank, row in enumerate(every) if row != every[0]), None)
        if differ is None or self._said or not self.world.is_main:
            return
        self._said = True
        what = (f"{every[differ][0]} items against rank 0's {every[0][0]}" if every[differ][0] != every[0][0]
                else "other items than rank 0's" if every[differ][1:] != every[0][1:] else "")
        warn_at_caller(f"the stream's first global batch of epoch {epoch} holds {what} on rank {differ} (its keys, "
                       "labels or token ids differ): every rank must read the same items in the same order, or the "
                       "ranks train on other data than one device would; seed the stream's shuffle (e.g. "
                       "dataset.shuffle(seed=42, buffer_size=...)) and read it in a fixed order")
