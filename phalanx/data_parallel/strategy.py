"""Data parallelism as the training loop's `Strategy` (train/loop.py): a replica on every rank.

`DataSplit` wraps a `DataParallel` (from `phalanx.prepare`, whose `choices` describe it): each
rank reads its shard of every global batch (`rows`), runs forward, backward and the gradient
exchange in `grad_accum_steps` micro-batches (step.py), clips by the global norm when asked,
builds the optimizer over its share (`make_optimizer`: sharded under `shard=`), and reports what the job's first log
line, metrics rows and guards need. The model splits (model_split/) provide the same interface.
"""

from __future__ import annotations

import torch
from torch import nn

from phalanx.data.split import accumulation_rows
from phalanx.data_parallel.clip import clip_grad_norm_
from phalanx.data_parallel.data_parallel import DataParallel
from phalanx.data_parallel.guards.checks import check_replicas
from phalanx.data_parallel.step import forward_backward
from phalanx.telemetry import Tracer


class DataSplit:
    """Data parallelism as a `Strategy`: a replica on every rank (from `phalanx.prepare`, whose
    `choices` describe it), each reading its shard of every global batch in `grad_accum_steps`
    micro-batches. Forward, backward and wait are traced to `tracer` (None: the replica's)."""

    holds_output = True

    def __init__(self, dp: DataParallel, *, grad_accum_steps: int = 1, max_grad_norm: float | None = None,
                 tracer: Tracer | None = None) -> None:
        self.dp, self.module, self.grad_accum_steps = dp, dp.module, grad_accum_steps
        self.max_grad_norm = max_grad_norm
        self.tracer = dp.tracer if tracer is None else tracer

    def rows(self, total: int) -> slice:
        """This rank's rows of a `total`-example batch: its contiguous shard, or with accumulation every
        k-th row, so that each micro-batch over all ranks is one device's (`accumulation_rows`)."""
        return self._layout(total)[0]

    def _layout(self, total: int) -> tuple[slice, list[int]]:
        # A batch of fewer examples than micro-batches (a tiny last batch) is cut into one piece per
        # example, as ShardedLoader's micro_batches cuts it (rank_micro_batches): a micro-batch empty on
        # every rank adds nothing, and under shard="parameters" its forward would gather every layer.
        pieces = max(1, min(self.grad_accum_steps, total))
        return accumulation_rows(total, self.dp.world.world_size, self.dp.world.rank, pieces)

    def zero_grad(self) -> None:
        self.dp.zero_grad()

    def forward_backward(self, X, y, *, global_batch_size):
        # The micro-batches' counts of the rows `rows` hands out; rows of another count (a caller's
        # own cut, through phalanx.train_batch) are cut evenly.
        sizes = self._layout(global_batch_size)[1] if self.grad_accum_steps > 1 else None
        sizes = sizes if sizes is not None and sum(sizes) == X.shape[0] else None
        sums = forward_backward(self.dp, X, y, global_batch_size=global_batch_size,
                                grad_accum_steps=self.grad_accum_steps, micro_sizes=sizes, tracer=self.tracer)
        if self.max_grad_norm is not None:  # by the summed gradient's global norm (clip.py)
            clip_grad_norm_(self.dp, self.max_grad_norm)
        return sums

    def make_optimizer(self, cls: type, **defaults) -> torch.optim.Optimizer:
        """The optimizer over this rank's share of the replica (`dp.optimizer`: sharded or not)."""
        return self.dp.optimizer(cls, **defaults)

    def predict(self, X: torch.Tensor) -> torch.Tensor:
        return self.dp(X)

    def named_gradients(self) -> dict[str, torch.Tensor]:
        """Nothing for the job's hook: the replica checks its own gradient (prepare's check_finite_every,
        which the job sets to --check-every), naming the rank whose share went NaN/Inf first."""
        return {}

    def check_replicas(self, step: int) -> None:
        """Buffers alike on every rank, by name: the replica compares its parameters and optimizer itself
        at the same steps (prepare's check_finite_every, which the job sets to --check-every)."""
        check_replicas(self.dp.world, self.module, step=step, buffers_only=True)

    def whole_model(self) -> nn.Module:
        return self.module  # every rank holds all of it (under shard="parameters": gather it first)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.module.load_state_dict(state)

    def describe(self) -> str:
        return self.dp.choices.describe()

    def facts(self) -> dict:
        chose = self.dp.choices
        return {"allreduce": chose.algorithm, "overlap": chose.overlap, "num_buckets": len(chose.bucket_kb),
                "grad_dtype": chose.grad_dtype, "grad_accum_steps": self.grad_accum_steps,
                "memory_format": chose.memory_format, "batchnorm": chose.batchnorm}

    def close(self) -> None:
        self.dp.close()
