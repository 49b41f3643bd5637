"""The two runs a verification compares: plain 1-device training, and one rank of k-device training.

`reference_run` is the trusted side (micrograd's habit: agree with a reference you can read):
the user's model in one process, no DataParallel, loss scaled by the configured rule at k = 1,
plain SGD. `rank_worker` runs in every spawned worker: the same model from the same seed,
made a replica by `phalanx.prepare` as `phalanx train` makes its own (SyncBatchNorm under the
`sync` policy, channels_last on CPU, DataParallel) and stepped by phalanx's own `train_batch` when the
loss is cross-entropy with phalanx's rule (so verify checks the production step), else by the
same five calls with the user's loss; with several configs (the diagnosis probes) a rank runs
them one after another in the same process group. Each run records, per step, the gradient the optimizer
used, the parameters and buffers after the update (rank 0 and the reference: full copies; every
rank: fingerprints), and fingerprints of the examples it received.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.data import shard_bounds
from phalanx.data_parallel import DataParallel, has_sync_batchnorm, prepare
from phalanx.errors import PhalanxWarning
from phalanx.train.loop import train_batch
from phalanx.verify.batches import BatchSource, example_digests, tensors_digest
from phalanx.verify.config import VerifyConfig, scale_loss
from phalanx.runtime.world import World

Snapshot = dict[str, dict[str, torch.Tensor]]  # "grad" / "param" / "buffer" -> name -> tensor


@dataclass(kw_only=True)
class RunRecord:
    """What one run (the reference, or one rank of a k-device run) saw and did, step by step."""

    rank: int
    world_size: int
    batch_sizes: list[int] = field(default_factory=list)  # the global batch of each step
    shard_sizes: list[int] = field(default_factory=list)  # this rank's part of it
    example_digests: list[list[str]] = field(default_factory=list)  # this rank's examples, per step
    param_digests: list[str] = field(default_factory=list)  # after each step
    buffer_digests: list[str] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # loss_fn's value on this rank's shard
    initial: dict[str, torch.Tensor] | None = None  # parameters before step 1 (full records only)
    snapshots: list[Snapshot] | None = None  # per step (full records only)
    num_batchnorm: int = 0
    num_dropout: int = 0


def count_modules(module: nn.Module) -> tuple[int, int]:
    """(BatchNorm layers, Dropout layers) in `module`: the two whose behaviour depends on the split."""
    bn = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())
    dropout = sum(isinstance(m, nn.modules.dropout._DropoutNd) for m in module.modules())
    return bn, dropout


def set_eval_modules(module: nn.Module, kinds: tuple[str, ...]) -> None:
    """Put the named kinds of layer in eval mode (BatchNorm: running statistics; Dropout: off)."""
    for m in module.modules():
        if ("batchnorm" in kinds and isinstance(m, nn.modules.batchnorm._BatchNorm)) or (
                "dropout" in kinds and isinstance(m, nn.modules.dropout._DropoutNd)):
            m.eval()


def build_model(model_fn: Callable[[], nn.Module], config: VerifyConfig) -> nn.Module:
    """The user's model from the run's seed, in the run's dtype: identical on every rank."""
    torch.manual_seed(config.seed)
    model = model_fn()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_fn must return an nn.Module, got {type(model).__name__}")
    return model.to(config.torch_dtype)


class _Recorder:
    def __init__(self, record: RunRecord, module: nn.Module, *, full: bool) -> None:
        self.record, self.module, self.full = record, module, full
        if full:
            record.initial = {n: p.detach().to(torch.float64, copy=True).cpu() for n, p in module.named_parameters()}
            record.snapshots = []

    def step(self, *, n_global: int, shard: tuple[torch.Tensor, torch.Tensor], loss: float) -> None:
        record, module = self.record, self.module
        record.batch_sizes.append(n_global)
        record.shard_sizes.append(shard[0].shape[0])
        record.example_digests.append(example_digests(*shard))
        record.losses.append(loss)
        params = list(module.named_parameters())
        buffers = list(module.named_buffers())
        record.param_digests.append(tensors_digest([p for _, p in params]))
        record.buffer_digests.append(tensors_digest([b for _, b in buffers]))
        if self.full:
            record.snapshots.append({
                "grad": {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().to(torch.float64, copy=True)
                         .cpu() for n, p in params},
                "param": {n: p.detach().to(torch.float64, copy=True).cpu() for n, p in params},
                "buffer": {n: _copy_buffer(b) for n, b in buffers},
            })


def _copy_buffer(buffer: torch.Tensor) -> torch.Tensor:
    return buffer.detach().to(torch.float64, copy=True).cpu() if buffer.is_floating_point() else buffer.detach().cpu().clone()


def reference_run(model_fn, loss_fn, data: Any, config: VerifyConfig, *, device: torch.device) -> RunRecord:
    """`config.steps` plain SGD steps of the whole global batch in this process.

    The caller's random state is left as it was (fork_rng): the run seeds the model and, for
    dropout, the steps, like every rank of the k-device run does.
    """
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        model = build_model(model_fn, config).to(device)
        record = RunRecord(rank=0, world_size=1)
        record.num_batchnorm, record.num_dropout = count_modules(model)
        model.train()
        set_eval_modules(model, config.eval_modules)
        optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
        recorder = _Recorder(record, model, full=True)
        source = BatchSource(data, config, device=device)
        torch.manual_seed(config.seed + 1)  # the steps' random stream (dropout), as on every rank
        for step in range(config.steps):
            X, y = source.batch(step)
            model.zero_grad(set_to_none=False)
            loss = loss_fn(model(X), y)
            scale_loss(loss, n_local=X.shape[0], n_global=X.shape[0], world_size=1,
                       reduction=config.loss_reduction, scale=config.loss_scale).backward()
            optimizer.step()
            recorder.step(n_global=X.shape[0], shard=(X, y), loss=float(loss.detach()))
    return record


def uses_train_batch(loss_fn, config: VerifyConfig) -> bool:
    """phalanx's train_batch is the step whenever it computes exactly what is asked for."""
    return loss_fn is F.cross_entropy and config.loss_reduction == "mean" and config.loss_scale == "global"


def rank_worker(world: World, model_fn, loss_fn, data: Any, configs: tuple[VerifyConfig, ...]) -> list[RunRecord]:
    """One rank of k-device runs (spawned by phalanx.runtime.launch), one per config, in this process group.

    Several configs share one spawn because starting the processes (`import torch`, ~2 s each)
    costs far more than a few small steps: the diagnosis probes all run in a second spawn.
    """
    return [_rank_run(world, model_fn, loss_fn, data, config) for config in configs]


def _rank_run(world: World, model_fn, loss_fn, data: Any, config: VerifyConfig) -> RunRecord:
    """The same model from the same seed, its own shard of every global batch, summed gradients."""
    model = build_model(model_fn, config)
    record = RunRecord(rank=world.rank, world_size=world.world_size)
    record.num_batchnorm, record.num_dropout = count_modules(model)
    model.train()
    set_eval_modules(model, config.eval_modules)
    dp = prepare(model, world=world, batchnorm=config.batchnorm, memory_format=config.memory_format,
                 algorithm=config.algorithm, overlap=config.overlap, bucket_cap_mb=config.bucket_cap_mb,
                 grad_dtype=config.grad_dtype)
    # The loop is verify's own, some probes wrong on purpose (a per-rank mean, a missing sync):
    # the first step's habit warnings would contradict the report, which is the diagnosis here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PhalanxWarning)
        try:
            optimizer = torch.optim.SGD(dp.module.parameters(), lr=config.lr)
            recorder = _Recorder(record, dp.module, full=world.is_main)
            source = BatchSource(data, config, device=world.device,
                                 seed_offset=world.rank if config.shuffle_per_rank else 0)
            production_step = uses_train_batch(loss_fn, config)
            torch.manual_seed(config.seed + 1)  # the same dropout stream on every rank (see diagnose.py)
            for step in range(config.steps):
                X, y = source.batch(step)
                n_global = X.shape[0]
                start, stop = shard_bounds(n_global, world.world_size, world.rank)
                X_shard, y_shard = X[start:stop], y[start:stop]
                if production_step:
                    loss_sum, _ = train_batch(dp, optimizer, X_shard, y_shard, global_batch_size=n_global)
                    loss = float(loss_sum) / X_shard.shape[0] if X_shard.shape[0] else float("nan")
                else:
                    loss = _step(dp, optimizer, loss_fn, X_shard, y_shard, n_global=n_global, world=world, config=config)
                recorder.step(n_global=n_global, shard=(X_shard, y_shard), loss=loss)
        finally:
            dp.close()
    return record


def _step(dp: DataParallel, optimizer, loss_fn, X, y, *, n_global: int, world: World, config: VerifyConfig) -> float:
    """zero_grad, forward, backward of the scaled loss, finish_gradient_sync, optimizer step."""
    dp.zero_grad()
    loss_value = float("nan")
    # An empty shard runs no backward (its rank still joins the exchange in finish_gradient_sync),
    # except with SyncBatchNorm, whose forward and backward are collectives every rank must join.
    if X.shape[0] > 0 or has_sync_batchnorm(dp.module):
        loss = loss_fn(dp(X), y)
        scale_loss(loss, n_local=X.shape[0], n_global=n_global, world_size=world.world_size,
                   reduction=config.loss_reduction, scale=config.loss_scale).backward()
        loss_value = float(loss.detach())
    dp.finish_gradient_sync()
    optimizer.step()
    return loss_value
