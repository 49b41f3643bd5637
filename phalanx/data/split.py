"""How one global batch becomes k shards: the book's `split_batch`, and the epoch order behind it.

Data parallelism (D2L, "Training on Multiple GPUs") draws one *global* minibatch per step and
gives each of the k devices a slice of it. Everything here is pure index arithmetic, identical on
every rank, so the ranks agree on who sees which example without talking to each other:
`global_batches` fixes the epoch's order from (seed, epoch) alone, `shard_sizes`/`shard_bounds`
cut any length into k near-equal contiguous pieces, and `split_batch` (one process, k shards) and
`rank_shard` (one shard per process) are two views of the same cut. This module does not move
data to devices and does not average anything; see the loss-weighting note on `shard_sizes`.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

# Mixes (seed, epoch) into one generator seed. A prime multiplier keeps (s, e) and (s+1, e')
# apart for every epoch count a run will reach.
_EPOCH_SEED_STRIDE = 1_000_003


class Ranked(Protocol):
    """What sharding needs of a `phalanx.World` (data/ sits below runtime/world.py, so it names no World)."""

    rank: int
    world_size: int


def shard_sizes(total: int, num_shards: int) -> list[int]:
    """`num_shards` sizes summing to `total`, differing by at most one, larger ones first.

    When `total` does not divide evenly (the last batch of an epoch, an odd evaluation set) the
    shards differ in size, so a per-shard *mean* loss must not be averaged with equal weights
    across shards: weight each shard's loss sum by 1 / global batch size instead, or the
    gradient is not the single-device one. A shard may be empty when total < num_shards; its
    owner still has to join every collective.
    """
    total, num_shards = operator.index(total), operator.index(num_shards)
    if num_shards < 1:
        raise ValueError(f"shard_sizes: num_shards must be >= 1, got {num_shards}")
    if total < 0:
        raise ValueError(f"shard_sizes: total must be >= 0, got {total}")
    base, extra = divmod(total, num_shards)
    return [base + 1] * extra + [base] * (num_shards - extra)


def shard_bounds(total: int, num_shards: int, index: int) -> tuple[int, int]:
    """(start, stop) of shard `index` in the cut `shard_sizes(total, num_shards)` describes."""
    sizes = shard_sizes(total, num_shards)
    index = operator.index(index)
    if not 0 <= index < num_shards:
        raise ValueError(f"shard_bounds: index {index} is outside 0..{num_shards - 1}")
    # Closed form of sum(sizes[:index]): the first `extra` shards are one longer.
    base, extra = divmod(total, num_shards)
    start = index * base + min(index, extra)
    return start, start + sizes[index]


def split_batch(X: torch.Tensor, y: torch.Tensor, num_shards: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split a minibatch (X, y) along dim 0 into `num_shards` (X_i, y_i) pairs, as in D2L.

    D2L's version scatters with `nn.parallel.scatter`, whose chunks are ceil-sized (a batch of
    10 over 4 devices gives 3,3,3,1 and may give fewer chunks than devices); here the sizes come
    from `shard_sizes` (3,3,2,2), the same cut `rank_shard` makes. The pieces are views of X and
    y; moving each to its device is the caller's job.
    """
    if X.shape[0] != y.shape[0]:
        raise ValueError(f"split_batch: X has {X.shape[0]} examples but y has {y.shape[0]}; they must match")
    sizes = shard_sizes(X.shape[0], num_shards)
    return list(zip(torch.split(X, sizes), torch.split(y, sizes)))


def accumulation_rows(total: int, world_size: int, rank: int, micro_batches: int) -> tuple[slice, list[int]]:
    """A rank's rows of a `total`-example global batch trained as `micro_batches` accumulated
    micro-batches, and how many of them fall in each micro-batch, in order.

    One device cuts the global batch into contiguous micro-batches (`shard_sizes(total,
    micro_batches)`). So that micro-batch j over all k ranks holds exactly one device's micro-batch
    j - what a synchronized BatchNorm normalizes over - the rank reads every k-th row from its own
    rank on: each rank then holds ⌊|Mj|/k⌋ or ⌈|Mj|/k⌉ of every micro-batch Mj, and in all
    `shard_sizes(total, k)[rank]` rows, as many as its contiguous shard. One micro-batch: that shard.
    """
    if micro_batches == 1:
        first, stop = shard_bounds(total, world_size, rank)
        return slice(first, stop), [stop - first]

    def read_before(position: int) -> int:  # rows rank, rank + k, ... below `position`
        return max(0, -((rank - position) // world_size))

    stops = list(itertools.accumulate(shard_sizes(total, micro_batches)))
    counts = [read_before(stop) - read_before(start) for start, stop in zip([0, *stops[:-1]], stops)]
    return slice(rank, total, world_size), counts


def rank_micro_batches(items: Sequence | torch.Tensor, *, rank: int, world_size: int, micro_batches: int) -> list:
    """A rank's rows of the global batch `items` as `micro_batches` pieces to accumulate, laid out
    by `accumulation_rows` (piece j over all ranks is one device's contiguous micro-batch j);
    fewer pieces where the batch holds fewer items than `micro_batches`, so that no micro-batch is
    empty on every rank (one rank's piece is empty where its micro-batch has fewer items than ranks)."""
    rows, counts = accumulation_rows(len(items), world_size, rank, max(1, min(micro_batches, len(items))))
    mine, stops = items[rows], list(itertools.accumulate(counts))
    return [mine[start:stop] for start, stop in zip([0, *stops[:-1]], stops)]


def steps_per_epoch(num_examples: int, global_batch_size: int) -> int:
    """Optimizer steps in one epoch: the last, smaller batch counts (it is not dropped)."""
    if global_batch_size < 1:
        raise ValueError(f"steps_per_epoch: global_batch_size must be >= 1, got {global_batch_size}")
    if num_examples < 0:
        raise ValueError(f"steps_per_epoch: num_examples must be >= 0, got {num_examples}")
    return math.ceil(num_examples / global_batch_size)


def global_batches(
    num_examples: int, global_batch_size: int, *, seed: int, epoch: int, shuffle: bool = True
) -> list[torch.Tensor]:
    """The epoch's global batches as int64 index tensors; every rank computes the same list.

    The permutation is a pure function of (seed, epoch): no shared RNG state to drift between
    ranks, and no `DistributedSampler.set_epoch` to forget (forgetting it repeats epoch 0's order
    every epoch). Every index appears exactly once; the last batch may be smaller.
    """
    steps = steps_per_epoch(num_examples, global_batch_size)  # validates both sizes
    if seed < 0 or epoch < 0:
        raise ValueError(f"global_batches: seed and epoch must be >= 0, got seed={seed}, epoch={epoch}")
    if shuffle:
        generator = torch.Generator().manual_seed(epoch_seed(seed, epoch))
        order = torch.randperm(num_examples, generator=generator)
    else:
        order = torch.arange(num_examples)
    # torch.split of an empty tensor yields one empty piece; an empty epoch has no steps.
    batches = list(torch.split(order, global_batch_size)) if num_examples else []
    assert len(batches) == steps, (len(batches), steps)
    return batches


def epoch_seed(seed: int, epoch: int) -> int:
    """The generator seed of epoch `epoch` of a run seeded `seed`: a pure function of the two."""
    return seed * _EPOCH_SEED_STRIDE + epoch


def rank_shard(items: Sequence | torch.Tensor, *, world: Ranked | None = None, rank: int | None = None,
               world_size: int | None = None) -> Sequence | torch.Tensor:
    """A rank's contiguous share of `items`: shard `rank` of `shard_sizes(len(items), world_size)`, the cut
    `ShardedLoader` and `split_batch` make. `items`: a tensor or an array (its rows, as a view) or a
    sequence (a list, tuple or range: its slice), as Accelerate's `split_between_processes` takes them. Whose share:
    `world=` (a `phalanx.World`: this rank's), or `rank=` and `world_size=` (any rank's)."""
    if world is not None:
        if rank is not None or world_size is not None:
            raise TypeError("rank_shard takes world= or rank= and world_size=, not both: rank_shard(items, "
                            "world=world) is this rank's share")
        rank, world_size = world.rank, world.world_size
    elif rank is None or world_size is None:
        raise TypeError("rank_shard needs whose share it is: rank_shard(items, world=world) for this rank's, or "
                        "rank= and world_size=")
    if isinstance(items, Mapping):  # Accelerate's split_between_processes cuts each value of a dict
        raise TypeError("rank_shard takes a tensor (its rows) or a sequence (a list, tuple or range), got "
                        f"{type(items).__name__}: cut each value, {{key: rank_shard(value, world=world) for key, value "
                        "in items.items()}")
    if isinstance(items, (str, bytes)) or not (hasattr(items, "__len__") and hasattr(items, "__getitem__")):
        raise TypeError(f"rank_shard takes a tensor (its rows) or a sequence (a list, tuple or range), got "
                        f"{type(items).__name__}: pass list(items)")
    if getattr(items, "ndim", 1) == 0:  # a 0-dim tensor or array
        raise ValueError("rank_shard: a 0-dim tensor has no rows to share; pass a tensor of rows (dim 0) or a list")
    start, stop = shard_bounds(len(items), world_size, rank)
    return items[start:stop]


@dataclass(frozen=True, kw_only=True)
class EpochBatches:
    """The batch schedule of a run: `global_batches` with the fixed arguments bound once."""

    num_examples: int
    global_batch_size: int
    seed: int
    shuffle: bool = True

    def __post_init__(self) -> None:
        steps_per_epoch(self.num_examples, self.global_batch_size)  # raises ValueError with the numbers
        if self.seed < 0:
            raise ValueError(f"EpochBatches: seed must be >= 0, got {self.seed}")

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(self.num_examples, self.global_batch_size)

    def epoch(self, epoch: int) -> list[torch.Tensor]:
        return global_batches(
            self.num_examples, self.global_batch_size, seed=self.seed, epoch=epoch, shuffle=self.shuffle
        )
