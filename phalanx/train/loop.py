"""The training loop, read top to bottom: `train_batch` is one lockstep step, `train_epoch` one pass.

`train_epoch` drives any way of splitting the work through one small interface, `Strategy`:
data parallelism (`DataSplit`: a DataParallel replica, each rank its shard of every batch) and
the model splits (pipeline, channels: every rank the whole batch through its part) alike.

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
from typing import Callable, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.comm import all_reduce_sum_
from phalanx.data import global_batches, shard_bounds, split_batch, to_float
from phalanx.parallel import DataParallel, has_sync_batchnorm
from phalanx.parallel.first_step import SHARD_LOSS_MARKS
from phalanx.parallel.guards import check_replicas
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
    number of tokens. The result is marked, so a replica's first step can tell a backward that
    came through here from a per-rank mean's (parallel/first_step.py)."""
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be at least 1, got {global_batch_size}")
    scaled = loss_sum / global_batch_size
    SHARD_LOSS_MARKS.note(scaled)
    return scaled


def micro_batches(X: torch.Tensor, y: torch.Tensor, grad_accum_steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cut a rank's shard into `grad_accum_steps` contiguous micro-batches, sizes as even as
    possible (larger first, some empty when the shard is smaller than the count): the book's
    `split_batch` cut, applied a second time inside the rank."""
    if grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps must be at least 1, got {grad_accum_steps}")
    return split_batch(X, y, grad_accum_steps)


class Strategy(Protocol):
    """How this rank takes part in training, whichever way the work is split (issue 19).

    `train_epoch` and the job drive data parallelism (`DataSplit`, below) and the model splits
    (parallel/model_split.py: pipeline, channels) through these alone: the loop reads rows
    [`rows(n)`) of each n-example global batch, calls `zero_grad`, then `forward_backward`
    (the gradients the optimizer needs, exchanged; returns this rank's (loss sum, correct)),
    then steps the optimizer over `module`'s parameters. Ranks with `holds_output` count loss,
    correct and examples. `predict` serves evaluation; `whole_model()` (a collective) and
    `load_full_state_dict` the checkpoints and model.pt; `named_gradients` and `check_replicas`
    (None where ranks hold different parts) the guards; `describe` and `facts` the log and rows.
    """

    module: nn.Module
    holds_output: bool
    check_replicas: Callable[[int], None] | None

    def rows(self, total: int) -> tuple[int, int]: ...
    def zero_grad(self) -> None: ...
    def forward_backward(self, X: torch.Tensor, y: torch.Tensor, *,
                         global_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def predict(self, X: torch.Tensor) -> torch.Tensor | None: ...
    def named_gradients(self) -> dict[str, torch.Tensor]: ...
    def whole_model(self) -> nn.Module: ...
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...
    def describe(self) -> str: ...
    def facts(self) -> dict: ...
    def close(self) -> None: ...


def forward_backward(dp: DataParallel, X: torch.Tensor, y: torch.Tensor, *, global_batch_size: int,
                     grad_accum_steps: int = 1, tracer: Tracer | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of this rank's shard (X, y), then the gradient exchange: afterwards
    every rank holds the summed gradient. Returns this shard's (loss sum, correct count).

    With `grad_accum_steps` N > 1 the shard runs as N micro-batches, gradients exchanged once.
    `tracer` records forward / backward / wait spans (None: tracing off).
    """
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
    if loss_sum is None:  # every piece was empty
        loss_sum = torch.zeros((), dtype=torch.float64, device=X.device)
        correct = torch.zeros((), dtype=torch.long, device=X.device)
    return loss_sum, correct


def train_batch(dp: DataParallel, optimizer: torch.optim.Optimizer, X: torch.Tensor, y: torch.Tensor, *,
                global_batch_size: int, grad_accum_steps: int = 1,
                tracer: Tracer | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One lockstep step on this rank's shard (X, y): zero_grad, `forward_backward`, optimizer
    step. Returns this shard's (loss sum, correct count); `tracer` also records the optimizer."""
    dp.zero_grad()
    loss_sum, correct = forward_backward(dp, X, y, global_batch_size=global_batch_size,
                                         grad_accum_steps=grad_accum_steps, tracer=tracer)
    with span(tracer, "optimizer"):
        optimizer.step()
    return loss_sum, correct


class DataSplit:
    """Data parallelism as a `Strategy`: a replica on every rank (from `phalanx.prepare`, whose
    `choices` describe it), each reading its shard of every global batch in `grad_accum_steps`
    micro-batches. Forward, backward and wait are traced to the replica's tracer (`dp.tracer`)."""

    holds_output = True

    def __init__(self, dp: DataParallel, *, grad_accum_steps: int = 1) -> None:
        self.dp, self.module, self.grad_accum_steps = dp, dp.module, grad_accum_steps

    def rows(self, total: int) -> tuple[int, int]:
        return shard_bounds(total, self.dp.world.world_size, self.dp.world.rank)

    def zero_grad(self) -> None:
        self.dp.zero_grad()

    def forward_backward(self, X, y, *, global_batch_size):
        return forward_backward(self.dp, X, y, global_batch_size=global_batch_size,
                                grad_accum_steps=self.grad_accum_steps, tracer=self.dp.tracer)

    def predict(self, X: torch.Tensor) -> torch.Tensor:
        return self.dp(X)

    def named_gradients(self) -> dict[str, torch.Tensor]:
        return self.dp.named_gradients()

    def check_replicas(self, step: int) -> None:
        check_replicas(self.dp.world, self.module, step=step)

    def whole_model(self) -> nn.Module:
        return self.module  # every rank holds all of it

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


def train_epoch(
    strategy: Strategy,
    optimizer: torch.optim.Optimizer,
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    world: World,
    global_batch_size: int,
    seed: int,
    epoch: int,
    on_step: Callable[[int, int], None] | None = None,
    tracer: Tracer | None = None,
    start_step: int = 0,
    start_totals: Sequence[float] = (),
    after_step: Callable[[int, int, torch.Tensor, Callable[[], list[float]]], None] | None = None,
) -> EpochStats:
    """One pass over (images, labels): the same permutation on every rank, each reads its rows.

    `start_step` skips the epoch's first steps (a resumed run: the permutation is seeded by
    (seed, epoch), so the remaining batches are exactly the ones an uninterrupted run trains on).
    `start_totals` (loss sum, correct, examples, seconds) are this rank's sums over the skipped
    steps, from the checkpoint. `after_step(steps_done, steps_total, loss_sum, running_totals)`
    runs after each optimizer step (checkpoints, guards); `running_totals()` returns the sums so
    far in start_totals' form (a call, so a GPU is synchronised only when they are needed);
    `on_step(steps_done, steps_total)` is for progress display. `tracer` records each step with
    its data and optimizer spans.
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
    dtype = next(strategy.module.parameters()).dtype

    def running_totals() -> list[float]:  # synchronises a GPU: called only when a value is needed
        return [*torch.stack([loss_total, correct_total.double()]).tolist(), examples, time.perf_counter() - start_s]

    for step, batch in enumerate(batches):
        if step < start_step:
            continue
        if tracer is not None:
            tracer.begin_step(step)
        with span(tracer, "step"):
            with span(tracer, "data"):
                first, stop = strategy.rows(batch.numel())
                shard = batch[first:stop]
                X = to_float(images[shard]).to(dtype)
                y = labels[shard]
            strategy.zero_grad()
            loss_sum, correct = strategy.forward_backward(X, y, global_batch_size=batch.numel())
            with span(tracer, "optimizer"):
                optimizer.step()
        if tracer is not None:
            tracer.end_step()
        loss_total.add_(loss_sum)
        correct_total.add_(correct)
        examples += shard.numel() if strategy.holds_output else 0
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
