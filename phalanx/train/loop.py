"""The training loop, read top to bottom: `train_step` is one lockstep step, `train_epoch` one pass.

Both drive any way of splitting the work through one small interface, `Strategy`: data
parallelism (data_parallel/strategy.py's `DataSplit`: a replica, each rank its shard of every
batch) and the model splits (model_split/: every rank the whole batch through its part) alike.
`train_step` is the one step - zero_grad, forward and backward with the exchange, the optimizer
step - that `phalanx train`'s epochs run and that `train_batch` (the book's name, for a replica)
exposes to verify, bench and predict, so what they check and time is what training runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch
from torch import nn

from phalanx.comm import all_reduce_sum_
from phalanx.data import global_batches, to_float
from phalanx.data_parallel import DataParallel
from phalanx.data_parallel.strategy import DataSplit
from phalanx.telemetry import Tracer, span
from phalanx.runtime.world import World
from phalanx.train.graphs import WARMUP_STEPS, CapturedStep, GraphBackend


@dataclass(frozen=True, kw_only=True)
class EpochStats:
    train_loss: float  # mean over every training example of the epoch, all ranks
    train_acc: float
    num_examples: int
    elapsed_s: float


class Strategy(Protocol):
    """How this rank takes part in training, whichever way the work is split.

    `train_epoch` and the job drive data parallelism (data_parallel/strategy.py's `DataSplit`) and
    the model splits (model_split/: pipeline, channels) through these alone: the loop reads the
    rows `rows(n)` (a slice) of each n-example global batch, calls `zero_grad`, then `forward_backward`
    (the gradients the optimizer needs, exchanged; returns this rank's (loss sum, correct)),
    then steps the optimizer over `module`'s parameters. Ranks with `holds_output` count loss,
    correct and examples. `predict` serves evaluation; `whole_model()` (a collective) and
    `load_full_state_dict` the checkpoints and model.pt; `named_gradients` and `check_replicas`
    (None where ranks hold different parts) the guards; `describe` and `facts` the log and rows;
    `make_optimizer(cls, **defaults)` the optimizer over what this rank updates.
    """

    module: nn.Module
    holds_output: bool
    check_replicas: Callable[[int], None] | None

    def rows(self, total: int) -> slice: ...
    def zero_grad(self) -> None: ...
    def forward_backward(self, X: torch.Tensor, y: torch.Tensor, *,
                         global_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def predict(self, X: torch.Tensor) -> torch.Tensor | None: ...
    def named_gradients(self) -> dict[str, torch.Tensor]: ...
    def whole_model(self) -> nn.Module: ...
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...
    def make_optimizer(self, cls: type, **defaults) -> torch.optim.Optimizer: ...
    def describe(self) -> str: ...
    def facts(self) -> dict: ...
    def close(self) -> None: ...


def train_step(strategy: Strategy, optimizer: torch.optim.Optimizer, X: torch.Tensor, y: torch.Tensor, *,
               global_batch_size: int, tracer: Tracer | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One lockstep step on this rank's rows (X, y) of a global batch: zero_grad, forward and
    backward with the gradient exchange (`strategy.forward_backward`), optimizer step. Returns
    this rank's (loss sum, correct count), on the device; `tracer` records the optimizer span."""
    strategy.zero_grad()
    loss_sum, correct = strategy.forward_backward(X, y, global_batch_size=global_batch_size)
    with span(tracer, "optimizer"):
        optimizer.step()
    return loss_sum, correct


def train_batch(dp: DataParallel, optimizer: torch.optim.Optimizer, X: torch.Tensor, y: torch.Tensor, *,
                global_batch_size: int, grad_accum_steps: int = 1,
                tracer: Tracer | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The book's `train_batch`: one `train_step` of replica `dp` on this rank's shard (X, y).
    Returns this shard's (loss sum, correct count); `tracer` records forward, backward, wait and
    the optimizer."""
    return train_step(DataSplit(dp, grad_accum_steps=grad_accum_steps, tracer=tracer), optimizer, X, y,
                      global_batch_size=global_batch_size, tracer=tracer)


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
    graph: CapturedStep | None = None,
) -> EpochStats:
    """One pass over (images, labels): the same permutation on every rank, each reads its rows.

    `start_step` skips the epoch's first steps (a resumed run: the permutation is seeded by
    (seed, epoch), so the remaining batches are exactly the ones an uninterrupted run trains on).
    `start_totals` (loss sum, correct, examples, seconds) are this rank's sums over the skipped
    steps, from the checkpoint. `after_step(steps_done, steps_total, loss_sum, running_totals)`
    runs after each optimizer step (checkpoints, guards); `running_totals()` returns the sums so
    far in start_totals' form (a call, so a GPU is synchronised only when they are needed);
    `on_step(steps_done, steps_total)` is for progress display. `tracer` records each step with
    its data and optimizer spans. `graph` (`captured_train_step`'s) runs every full global batch;
    a smaller last batch runs eagerly, so no example is dropped or padded.
    """
    earlier_s = float(start_totals[3]) if len(start_totals) == 4 else 0.0
    start_s = time.perf_counter() - earlier_s
    device = images.device
    batches = _on_device(global_batches(images.shape[0], global_batch_size, seed=seed, epoch=epoch), device)
    # Running sums stay on the device (torch.full writes a scalar, no host copy); the example
    # count is host arithmetic. Nothing inside the loop reads a device value: on a GPU each read would
    # make the host wait for the device.
    earlier = list(start_totals[:3]) if len(start_totals) == 4 else [0.0, 0, 0]
    loss_total = torch.full((), float(earlier[0]), dtype=torch.float64, device=world.device)
    correct_total = torch.full((), int(earlier[1]), dtype=torch.long, device=world.device)
    examples = int(earlier[2])
    dtype = next(strategy.module.parameters()).dtype

    def running_totals() -> list[float]:  # synchronises a GPU: called only when a value is needed
        return [*torch.stack([loss_total, correct_total.double()]).tolist(), examples, time.perf_counter() - start_s]

    rows: dict[int, slice] = {}  # this rank's rows of an n-example batch, by n
    for step, batch in enumerate(batches):
        if step < start_step:
            continue
        if tracer is not None:
            tracer.begin_step(step)
        n = batch.numel()
        mine = rows[n] if n in rows else rows.setdefault(n, strategy.rows(n))
        shard = batch if mine == slice(0, n) else batch[mine]
        with span(tracer, "step"):
            if graph is not None and n == global_batch_size:
                loss_sum, correct = graph(shard)
            else:
                with span(tracer, "data"):
                    # index_select copies each row whole, where images[shard] indexed pixel by pixel: 354 us
                    # against 31 for 256 rows of 28 x 28 on one thread; cpu:2's data span 229 -> 113 us.
                    X = to_float(images.index_select(0, shard), dtype)
                    y = labels.index_select(0, shard)
                loss_sum, correct = train_step(strategy, optimizer, X, y, global_batch_size=n, tracer=tracer)
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


def captured_train_step(strategy: DataSplit, optimizer: torch.optim.Optimizer, images: torch.Tensor,
                        labels: torch.Tensor, *, global_batch_size: int, backend: GraphBackend,
                        say: Callable[[str], None], warmup_steps: int = WARMUP_STEPS) -> CapturedStep:
    """`train_step` on this rank's rows of a full global batch, as a CUDA graph (graphs.py) that
    `train_epoch(graph=...)` runs: the rows' indices go through one static buffer, and the step
    reads images and labels (resident on the device) through it, as the eager step does."""
    index = torch.zeros(len(range(global_batch_size)[strategy.rows(global_batch_size)]), dtype=torch.long,
                        device=images.device)
    dtype = next(strategy.module.parameters()).dtype

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        X = to_float(images.index_select(0, index), dtype)
        return train_step(strategy, optimizer, X, labels.index_select(0, index), global_batch_size=global_batch_size)

    dp = strategy.dp
    return CapturedStep(step, inputs=(index,), module=strategy.module, optimizer=optimizer, backend=backend,
                        warmup_steps=warmup_steps, capturing=dp.capturing, after_replay=dp.finish_gradient_sync, say=say)


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
