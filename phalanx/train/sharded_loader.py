"""`phalanx.ShardedLoader`: data/loader.py's, plus the check that a stream yields the same items
on every rank.

Over a stream (an `IterableDataset`), every rank reads the whole stream and keeps its slice of
each global batch, so the global batch is one device's only if every rank's stream yields the same
items in the same order. A stream shuffled without a fixed seed (Hugging Face's
`IterableDataset.shuffle()` without one draws a seed in each process; Accelerate hides this by
reading the stream on rank 0 alone and sending the batches out) gives each rank other items: some
of the data is trained on twice in an epoch and some never, silently. So at the first global batch
of every epoch, before anything is trained on it, the ranks all-gather one small record of its
items' identities (`identity_checksum`: strings, bytes, whole numbers, token ids; not floating
values, which a per-rank random augmentation may change) and rank 0 warns, once, naming the first
rank whose items differ and the fix. One gather of 3 numbers an epoch; nothing for a map-style
dataset, whose order is a permutation of (seed, epoch) on every rank by construction, nor in a
world of one, nor for a stand-in for the world that opened no process group (tests).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from phalanx.comm.gather import gather
from phalanx.data.item_identity import identity_checksum
from phalanx.data.loader import ShardedLoader as LocalShardedLoader
from phalanx.errors import PhalanxWarning
from phalanx.runtime.world import World


class ShardedLoader(LocalShardedLoader):
    __doc__ = LocalShardedLoader.__doc__

    _said = False  # whether this loader warned already: once is enough

    def __init__(self, dataset, *, world, **kwargs) -> None:
        if isinstance(world, World):  # tests hand data/loader.py stand-ins for the world
            world.check_here("phalanx.ShardedLoader")
        super().__init__(dataset, world=world, **kwargs)

    def _first_chunk(self, epoch: int, items: list) -> None:
        """Compare the ranks' first global batch of `epoch` (module docstring)."""
        world = self.world
        if not (isinstance(world, World) and world.distributed and dist.is_initialized()):
            return
        count, checksum = identity_checksum(items)
        mine = torch.tensor([[len(items), count, checksum]], dtype=torch.int64)
        every = gather(mine, world=world).tolist()
        differ = next((rank for rank, row in enumerate(every) if row != every[0]), None)
        if differ is None or self._said or not world.is_main:
            return
        self._said = True
        what = (f"{every[differ][0]} items against rank 0's {every[0][0]}" if every[differ][0] != every[0][0]
                else "other items than rank 0's" if every[differ][1:] != every[0][1:] else "")
        warnings.warn(f"the stream's first global batch of epoch {epoch} holds {what} on rank {differ} (its keys, "
                      "labels or token ids differ): every rank must read the same items in the same order, or the "
                      "ranks train on other data than one device would; seed the stream's shuffle (e.g. "
                      "dataset.shuffle(seed=42, buffer_size=...)) and read it in a fixed order", PhalanxWarning,
                      stacklevel=6)  # the user's loop: epoch(), _stream_epoch, stream_shards, the lambda, here
