"""Data parallelism's step on one rank: the loss-scaling rule and forward, backward, exchange.

Loss scaling is where data parallelism is exact or subtly wrong. Each rank computes the *sum* of
its shard's losses divided by the *global* batch size (`shard_loss`), so after the gradients are
summed across ranks the update is the 1-device update on the whole global batch - also for an
uneven last batch, where averaging per-rank means would weight the small shards too heavily.

Gradient accumulation composes with that rule unchanged: a rank cuts *its* rows into N
micro-batches (`micro_batches`) and runs them through `dp.accumulate` (accumulate.py): the first
N-1 under `no_sync()`, so their gradients only add up in the buckets, the last synced. Each
micro-batch still contributes its loss sum / global batch size, so the summed gradient - and the
update - equals the 1-device update on the whole global batch. `phalanx train` hands each rank
every k-th row of the global batch (`accumulation_rows`), so micro-batch j over all ranks is one
device's micro-batch j: a synchronized BatchNorm normalizes it over the same examples as 1 device.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from phalanx.data import split_batch
from phalanx.data_parallel.data_parallel import DataParallel
from phalanx.data_parallel.guards.first_step import mark_shard_loss
from phalanx.data_parallel.sharding.gather_hooks import collective_forward
from phalanx.data_parallel.sync_batchnorm import has_sync_batchnorm
from phalanx.telemetry import Tracer, span


def shard_loss(loss_sum: torch.Tensor, global_batch_size: int) -> torch.Tensor:
    """What a rank backpropagates: its shard's loss *sum* / the *global* batch size.

    After the ranks' gradients are summed this is exactly the 1-device gradient of the mean loss
    over the global batch, for any split (even or not). For a loss over tokens, pass the global
    number of tokens. The result is marked, so a replica's first step can tell a backward that
    came through here from a per-rank mean's (data_parallel/guards/first_step.py)."""
    if not isinstance(loss_sum, torch.Tensor):  # loss.item(): a number backward cannot go through
        raise TypeError(f"shard_loss takes the shard's loss sum as a tensor, got {type(loss_sum).__name__}: pass the "
                        "loss itself (F.cross_entropy(out, y, reduction='sum')), not its .item()")
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be at least 1, got {global_batch_size}")
    scaled = loss_sum / global_batch_size
    mark_shard_loss(scaled, global_batch_size, loss_sum)
    return scaled


@functools.lru_cache(maxsize=16)
def _inverse(global_batch_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """1 / global_batch_size as the 0-dim tensor backward feeds `loss_sum`: made by the division
    shard_loss's backward does, so the gradient is bitwise shard_loss's on every device."""
    return torch.ones((), dtype=dtype, device=device) / global_batch_size


def micro_batches(X: torch.Tensor, y: torch.Tensor, grad_accum_steps: int,
                  sizes: Sequence[int] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cut a rank's rows into `grad_accum_steps` contiguous micro-batches of `sizes` rows (the
    counts `accumulation_rows` gives), or, with no sizes, as even as possible (larger first, some
    empty when the shard is smaller than the count): the book's `split_batch` cut, applied a
    second time inside the rank."""
    if grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps must be at least 1, got {grad_accum_steps}")
    if sizes is None:
        return split_batch(X, y, grad_accum_steps)
    return list(zip(torch.split(X, list(sizes)), torch.split(y, list(sizes))))


def forward_backward(dp: DataParallel, X: torch.Tensor, y: torch.Tensor, *, global_batch_size: int,
                     grad_accum_steps: int = 1, micro_sizes: Sequence[int] | None = None,
                     tracer: Tracer | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of this rank's shard (X, y), then the gradient exchange: afterwards
    every rank holds the summed gradient. Returns this shard's (loss sum, correct count), on the
    device: the loss sum in the model's dtype for one piece, in float64 when pieces are added.

    With `grad_accum_steps` N > 1 the shard runs as N micro-batches (of `micro_sizes` rows; None:
    as even as they can be), gradients exchanged once.
    `tracer` records forward / backward / wait spans (None: tracing off).
    """
    if grad_accum_steps == 1 and X.shape[0] > 0:
        # The common case is the plain loop's step with nothing around it: no split, no
        # accumulator tensors, and the loss scaled without shard_loss's look at the graph once
        # the replica's first-step check is done (a world of one never has one).
        with span(tracer, "forward"):
            logits = dp(X)
            loss_sum = F.cross_entropy(logits, y, reduction="sum")
        with span(tracer, "backward"):
            if dp.first_step_pending:
                shard_loss(loss_sum, global_batch_size).backward()
            else:  # shard_loss's gradient, 1 / global batch size, fed in: no division kernel either way
                loss_sum.backward(_inverse(global_batch_size, loss_sum.dtype, loss_sum.device))
        with span(tracer, "wait"):
            dp.finish_gradient_sync()
        return loss_sum.detach(), (logits.argmax(dim=1) == y).sum()
    pieces = micro_batches(X, y, grad_accum_steps, micro_sizes)
    loss_sum = correct = None
    # dp.accumulate: every piece but the last under no_sync, the last with sync on, so its hooks
    # launch the buckets (overlap). Closed on the way out, so an error in a piece restores sync.
    with contextlib.closing(dp.accumulate(pieces)) as synced_last:
        for X_micro, y_micro in synced_last:
            # An empty piece (a tiny last batch) runs no backward; the rank still joins every
            # allreduce in finish_gradient_sync, which launches the buckets no hook launched.
            # With synchronized BatchNorm, or parameters gathered per layer (shard="parameters"),
            # forward and backward are collectives: an empty piece still runs them (zero counts)
            # so the rank stays paired with its peers.
            if X_micro.shape[0] > 0 or has_sync_batchnorm(dp.module) or collective_forward(dp.module):
                with span(tracer, "forward"):
                    logits = dp(X_micro)
                    micro_loss_sum = F.cross_entropy(logits, y_micro, reduction="sum")
                with span(tracer, "backward"):
                    shard_loss(micro_loss_sum, global_batch_size).backward()
                piece_loss, piece_correct = micro_loss_sum.detach().double(), (logits.argmax(dim=1) == y_micro).sum()
                loss_sum = piece_loss if loss_sum is None else loss_sum + piece_loss
                correct = piece_correct if correct is None else correct + piece_correct
    with span(tracer, "wait"):
        dp.finish_gradient_sync()
    if loss_sum is None:  # every piece was empty
        loss_sum = torch.zeros((), dtype=torch.float64, device=X.device)
        correct = torch.zeros((), dtype=torch.long, device=X.device)
    return loss_sum, correct
