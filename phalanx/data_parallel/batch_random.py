"""Random draws per sample that make k devices equal 1 device: `BatchRandom` and routed dropout.

A step that draws random numbers (dropout masks, a diffusion model's timesteps and noise, MAE's
masking) parts k devices from 1 device: each rank draws for its own shard from its own stream, so
no row gets the number one device draws for it. `BatchRandom` keeps one generator in the same
state on every rank (and on one device, seeded alike); each draw makes the *global* batch's tensor
and keeps this rank's rows, the cut `shard_bounds` makes and `ShardedLoader`/`rank_shard` hand out.
So k ranks consume the generator exactly as one device does, and every row gets one device's
number. The price is that each rank draws all the global batch's rows of the drawn tensors (k-fold
RNG work for those tensors only; torch's CPU generator cannot skip ahead to a rank's rows): an
MLP's step with two 512-wide dropouts at global batch 256 took 1.03x / 1.11x / 1.21x torch's
dropout step at k = 2 / 4 / 8 (one thread, 15 interleaved rounds).

What it cannot make exact it refuses: a draw whose dim 0 is not the rank's rows (a batch dim
elsewhere, rows that are tokens, not samples) is one line. A draw that mixes rows (mixup's
permutation of the batch) needs other ranks' rows and is out of its reach; a number shared by the
whole batch (mixup's lambda) is exact from any generator seeded alike on every rank.
`route_dropout(model)` puts `nn.Dropout`, `Dropout1d/2d/3d` under it; attention's own dropout
(`nn.MultiheadAttention(dropout=...)`, `F.dropout` inside) and alpha dropout are refused, not left
per-rank. An `F.dropout` a forward calls itself is out of its sight: draw such masks with `rand`.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from phalanx.data.split import shard_bounds
from phalanx.errors import UsageError
from phalanx.runtime.call_habits import phalanx_call
from phalanx.runtime.world import World

# Channel dropouts: the mask is one number per (sample, channel), broadcast over this many dims.
_CHANNEL_DROPOUTS = {nn.Dropout1d: 1, nn.Dropout2d: 2, nn.Dropout3d: 3}
_ROUTED = (nn.Dropout, *_CHANNEL_DROPOUTS)


class BatchRandom:
    """One generator, in the same state on every rank; draws are the global batch's, cut to this rank.

        draws = phalanx.BatchRandom(world=world, seed=0)
        for (xb, yb), global_size in loader.epoch(epoch):
            with draws.batch(global_size):
                t = draws.randint(0, T, (xb.shape[0],))
                noise = draws.randn_like(xb)
                loss_sum = ...

    `state_dict()`/`load_state_dict()` make it a `phalanx.checkpoint` extra, so a resume goes on
    with the same draws.
    """

    @phalanx_call
    def __init__(self, *, world: World, seed: int = 0) -> None:
        self.world = world
        self.seed = seed
        self.generator = torch.Generator(device=world.device).manual_seed(seed)
        self._global_size: int | None = None

    @contextlib.contextmanager
    def batch(self, global_size: int) -> Iterator[BatchRandom]:
        """The step's global batch size, as `ShardedLoader` yields it: draws inside take its rows."""
        if isinstance(global_size, bool) or not isinstance(global_size, int) or global_size < 0:
            raise UsageError(f"BatchRandom.batch: global_size must be the global batch's size (an int >= 0), "
                             f"got {global_size!r}; pass the size ShardedLoader.epoch yields")
        if self._global_size is not None:
            raise UsageError(f"BatchRandom.batch({global_size}) inside batch({self._global_size}): one global "
                             "batch at a time; leave the first `with` block before the next step's")
        self._global_size = global_size
        try:
            yield self
        finally:
            self._global_size = None

    def rows(self) -> tuple[int, int]:
        """(start, stop) of this rank's rows in the current global batch."""
        if self._global_size is None:
            raise UsageError("BatchRandom: a draw outside `with draws.batch(global_size):`; draws are the global "
                             "batch's rows, so wrap the step in that block with the size ShardedLoader yields")
        return shard_bounds(self._global_size, self.world.world_size, self.world.rank)

    def _draw(self, what: str, shape, make) -> torch.Tensor:
        shape = tuple(shape)
        start, stop = self.rows()
        if not shape or shape[0] != stop - start:
            got = "a 0-dim tensor" if not shape else f"{shape[0]} rows (shape {list(shape)})"
            raise UsageError(
                f"BatchRandom.{what}: {got}, but rank {self.world.rank}'s share of the global batch of "
                f"{self._global_size} is rows {start}:{stop} ({stop - start}); draws are per sample along dim 0 of "
                "this rank's shard: put the batch dim first (x.transpose(0, 1)) and draw for the samples, not "
                "for tokens or pixels flattened into rows; under accumulation draw for the rank's whole shard before "
                "its micro-batches and slice, as routed dropout inside a micro-batch cannot")
        whole = make((self._global_size, *shape[1:]))
        return whole[start:stop]

    def rand(self, shape, *, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
        return self._draw("rand", shape, lambda s: torch.rand(s, generator=self.generator, dtype=dtype,
                                                              device=self.generator.device)).to(device or self.world.device)

    def randn(self, shape, *, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
        return self._draw("randn", shape, lambda s: torch.randn(s, generator=self.generator, dtype=dtype,
                                                                device=self.generator.device)).to(device or self.world.device)

    def randint(self, low: int, high: int, shape, *, device=None) -> torch.Tensor:
        return self._draw("randint", shape, lambda s: torch.randint(low, high, s, generator=self.generator,
                                                                    device=self.generator.device)).to(device or self.world.device)

    def rand_like(self, x: torch.Tensor) -> torch.Tensor:
        return self.rand(x.shape, dtype=x.dtype, device=x.device)

    def randn_like(self, x: torch.Tensor) -> torch.Tensor:
        return self.randn(x.shape, dtype=x.dtype, device=x.device)

    def __deepcopy__(self, memo: dict) -> BatchRandom:
        # The draws are the run's, not a model's: a copied model (an EMA, a teacher) draws through
        # the same generator inside the same `batch` block, instead of a copy no block ever opens.
        return self

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.seed = state["seed"]

    def route_dropout(self, model: nn.Module) -> int:
        """Swap `model`'s dropout modules for ones whose masks come from these draws; returns how many.
        Before `prepare`: the swapped modules hold no parameters, so the replica is the same."""
        for name, module in model.named_modules():
            where = f"model.{name}" if name else "the model"
            if isinstance(module, nn.MultiheadAttention) and module.dropout > 0:
                raise UsageError(f"BatchRandom.route_dropout: {where} is a MultiheadAttention with "
                                 f"dropout={module.dropout}, drawn inside F.dropout per rank, which no routing reaches; "
                                 f"set {where}.dropout = 0.0 (an nn.Dropout after it is routed), or leave dropout per-rank")
            if isinstance(module, (nn.AlphaDropout, nn.FeatureAlphaDropout)) and module.p > 0:
                raise UsageError(f"BatchRandom.route_dropout: {where} is an {type(module).__name__}(p={module.p}), whose "
                                 "masks it does not draw; use nn.Dropout there, or leave dropout per-rank")
        return _swap(model, self)


class BatchDropout(nn.Module):
    """`nn.Dropout` (or a channel dropout, `dims` > 0) whose mask is drawn through a `BatchRandom`."""

    def __init__(self, p: float, *, draws: BatchRandom, dims: int = 0, inplace: bool = False) -> None:
        super().__init__()
        self.p, self.dims, self.inplace, self.draws = p, dims, inplace, draws

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if self.dims and x.dim() != self.dims + 2:
            raise UsageError(f"BatchDropout: a Dropout{self.dims}d input of shape {list(x.shape)}, not batched "
                             f"(N, C, {', '.join('*' * self.dims)}); draws are per sample, so give it a batch dim")
        shape = x.shape[:2] + (1,) * self.dims if self.dims else x.shape
        # Half-precision uniforms are coarse: bfloat16 ones kept 0.8981 of the entries at p = 0.1 (2 M
        # draws, 10 standard errors off 0.9), so a half input's mask is drawn in float32.
        dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        keep = self.draws.rand(shape, dtype=dtype, device=x.device) >= self.p
        scaled = keep.to(x.dtype) / (1 - self.p) if self.p < 1 else keep.to(x.dtype)
        return x.mul_(scaled) if self.inplace else x * scaled

    def extra_repr(self) -> str:
        return f"p={self.p}, dims={self.dims}, inplace={self.inplace}, drawn per global batch"


def _swap(module: nn.Module, draws: BatchRandom) -> int:
    count = 0
    for name, child in module.named_children():
        if type(child) in _ROUTED:
            setattr(module, name, BatchDropout(child.p, draws=draws, dims=_CHANNEL_DROPOUTS.get(type(child), 0),
                                               inplace=child.inplace))
            count += 1
        else:
            count += _swap(child, draws)
    return count
