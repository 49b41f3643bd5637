"""The training loop, read top to bottom: `train_batch` is one lockstep step, `train_epoch` one pass.

Loss scaling is where data parallelism is exact or subtly wrong. Each rank computes the *sum* of
its shard's losses divided by the *global* batch size, so after the gradients are summed across
ranks the update is the 1-device update on the whole global batch - also for an uneven last
batch, where averaging per-rank means would weight the small shards too heavily.

Gradient accumulation composes with that rule unchanged: a rank cuts *its* shard into N
micro-batches (`micro_batches`), runs the first N-1 under `no_sync()` so their gradients only
add up in the buckets, and syncs on the last. Each micro-batch still contributes its loss sum /
global batch size, so the summed gradient - and the update - equals the 1-device update on the
whole global batch. Cutting the rank's shard (rather than cutting the global batch into N
smaller global batches first) keeps every rank on exactly the examples `rank_shard` gives it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from phalanx.comm import all_reduce_sum_
from phalanx.data import global_batches, rank_shard, split_batch, to_float
from phalanx.parallel import DataParallel, has_sync_batchnorm
from phalanx.telemetry import Tracer, span
from phalanx.world import World


@dataclass(frozen=True, kw_only=True)
class EpochStats:
    train_loss: float  # mean over every training example of the epoch, all ranks
    train_acc: float
    num_examples: int
    elapsed_s: float


def shard_loss(loss_sum: torch.Tensor, global_batch_size: int) -> torch.Tensor:
    """What a rank backpropagates: its shard's loss *sum* / the *global* batch size.

    After the ranks' gradients are summed this is exactly the 1-device gradient of the mean loss
    over the global batch, for any split (even or not). For a loss over tokens, pass the global
    number of tokens."""
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be at least 1, got {global_batch_size}")
    return loss_sum / global_batch_size


def micro_batches(X: torch.Tensor, y: torch.Tensor, grad_accum_steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cut a rank's shard into `grad_accum_steps` contiguous micro-batches, sizes as even as
    possible (larger first, some empty when the shard is smaller than the count): the book's
    `split_batch` cut, applied a second time inside the rank."""
    if grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps must be at least 1, got {grad_accum_steps}")
    return split_batch(X, y, grad_accum_steps)


def train_batch(
    dp: DataParallel,
    optimizer: torch.optim.Optimizer,
    X: torch.Tensor,
    y: torch.Tensor,
    *,
    global_batch_size: int,
    grad_accum_steps: int = 1,
    tracer: Tracer | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step on this rank's shard (X, y); returns this shard's (loss sum, correct count).

    With `grad_accum_steps` N > 1 the shard runs as N micro-batches, gradients exchanged once.
    `tracer` records forward / backward / wait / optimizer spans (None: tracing off).
    """
    dp.zero_grad()
    # One piece in the common case: the step is then the plain loop's, with nothing around it
    # (no split, no accumulator tensors); the sums stay on the device (issue 11).
    pieces = [(X, y)] if grad_accum_steps == 1 else micro_batches(X, y, grad_accum_steps)
    loss_sum = correct = None
    for index, (X_micro, y_micro) in enumerate(pieces):
        last = index == len(pieces) - 1
        # The last micro-batch runs with sync on: its hooks launch the buckets (overlap).
        with contextlib.nullcontext() if last else dp.no_sync():
            # An empty piece (a tiny last batch) runs no backward; the rank still joins every
            # allreduce in finish_gradient_sync, which launches the buckets no hook launched.
            # With synchronized BatchNorm forward and backward are collectives: an empty piece
            # still runs them (zero counts) so the rank stays paired with its peers.
            if X_micro.shape[0] > 0 or has_sync_batchnorm(dp.module):
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
    with span(tracer, "optimizer"):
        optimizer.step()
    if loss_sum is None:  # every piece was empty
        loss_sum = torch.zeros((), dtype=torch.float64, device=X.device)
        correct = torch.zeros((), dtype=torch.long, device=X.device)
    return loss_sum, correct


def train_epoch(
    dp: DataParallel,
    optimizer: torch.optim.Optimizer,
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    world: World,
    global_batch_size: int,
    seed: int,
    epoch: int,
    grad_accum_steps: int = 1,
    on_step: Callable[[int, int], None] | None = None,
    tracer: Tracer | None = None,
    start_step: int = 0,
    start_totals: Sequence[float] = (),
    after_step: Callable[[int, int, torch.Tensor, Callable[[], list[float]]], None] | None = None,
) -> EpochStats:
    """One pass over (images, labels): same permutation on every rank, each reads its shard.

    `start_step` skips the epoch's first steps (a resumed run: the permutation is seeded by
    (seed, epoch), so the remaining batches are exactly the ones an uninterrupted run trains on).
    `start_totals` (loss sum, correct, examples, seconds) are this rank's sums over the skipped
    steps, from the checkpoint. `after_step(steps_done, steps_total, loss_sum, running_totals)`
    runs after each optimizer step (checkpoints, guards); `running_totals()` returns the sums so
    far in start_totals' form (a call, so a GPU is synchronised only when they are needed);
    `on_step(steps_done, steps_total)` is for progress display.
    """
    earlier_s = float(start_totals[3]) if len(start_totals) == 4 else 0.0
    start_s = time.perf_counter() - earlier_s
    device = images.device
    batches = _on_device(global_batches(images.shape[0], global_batch_size, seed=seed, epoch=epoch), device)
    # Running sums stay on the device (torch.full writes a scalar, no host copy); the example
    # count is host arithmetic. Nothing inside the loop reads a device value (issue 11).
    earlier = list(start_totals[:3]) if len(start_totals) == 4 else [0.0, 0, 0]
    loss_total = torch.full((), float(earlier[0]), dtype=torch.float64, device=world.device)
    correct_total = torch.full((), int(earlier[1]), dtype=torch.long, device=world.device)
    examples = int(earlier[2])
    dtype = next(dp.module.parameters()).dtype

    def running_totals() -> list[float]:  # synchronises a GPU: called only when a value is needed
        return [*torch.stack([loss_total, correct_total.double()]).tolist(), examples, time.perf_counter() - start_s]

    for step, batch in enumerate(batches):
        if step < start_step:
            continue
        if tracer is not None:
            tracer.begin_step(step)
        with span(tracer, "step"):
            with span(tracer, "data"):
                shard = rank_shard(batch, rank=world.rank, world_size=world.world_size)
                X = to_float(images[shard]).to(dtype)
                y = labels[shard]
            loss_sum, correct = train_batch(
                dp, optimizer, X, y, global_batch_size=batch.numel(), grad_accum_steps=grad_accum_steps,
                tracer=tracer,
            )
        if tracer is not None:
            tracer.end_step()
        loss_total.add_(loss_sum)
        correct_total.add_(correct)
        examples += shard.numel()
        if after_step is not None:
            after_step(step + 1, len(batches), loss_sum, running_totals)
        if on_step is not None:
            on_step(step + 1, len(batches))
    totals = torch.stack([loss_total, correct_total.double(), torch.full_like(loss_total, examples)])
    all_reduce_sum_(totals, world=world)  # one collective per epoch for the metrics
    loss, correct_count, count = totals.tolist()  # also waits for the device's last step
    elapsed_s = time.perf_counter() - start_s
    count = max(1, int(count))  # a resumed epoch may have had no step left
    return EpochStats(train_loss=loss / count, train_acc=correct_count / count, num_examples=count,
                      elapsed_s=elapsed_s)


def _on_device(batches: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The epoch's index batches on `device`: one copy of the whole permutation per epoch, from
    pinned memory and asynchronous on CUDA (a pageable copy per step would synchronise the host
    with the GPU every step); on the CPU, the batches as they are."""
    if device.type == "cpu" or not batches:
        return batches
    order = torch.cat(batches)
    if device.type == "cuda":
        order = order.pin_memory().to(device, non_blocking=True)
    else:
        order = order.to(device)
    return list(torch.split(order, [b.numel() for b in batches]))
