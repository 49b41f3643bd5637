"""`phalanx verify --split layers|channels`: the model-parallel splits against 1 device, step by step.

The same comparison as for data parallelism (compare.py's per-step, per-tensor relative
differences of the gradients the optimizer used and the parameters after each update), with
the reference from run.py's `reference_run`. Each k-device run builds the model from the same
seed, takes this rank's share (`build_split`), and steps every global batch; after each step the
shards of the gradients and parameters are gathered and assembled into whole-model tensors on
every rank, so rank 0's record holds the whole model like a data-parallel rank 0's does. The
data check differs: every rank must see the *whole* global batch (nobody holds a shard of it),
and the "replica" check compares the assembled model across ranks. No diagnosis probes: they
name data-parallel culprits.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from phalanx.runtime.devices import DevicePlan
from phalanx.runtime.launch import LaunchSpec, launch
from phalanx.model_split.splits import build_split, check_split
from phalanx.verify.batches import BatchSource, example_digests, tensors_digest
from phalanx.verify.compare import Comparison, check_replicas, compare_step, gradient_scale
from phalanx.verify.config import VerifyConfig
from phalanx.verify.report import VerifyReport, WorldResult
from phalanx.verify.run import RunRecord, build_model, reference_run
from phalanx.runtime.world import World


def _float64(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.detach().to(torch.float64, copy=True).cpu() for n, t in named.items()}


def split_rank_worker(world: World, model_fn, data, config: VerifyConfig, split: str, micro_batches: int | None,
                      schedule: str) -> RunRecord:
    """One rank of a k-device model-parallel run; rank 0's record holds the assembled whole model."""
    model = build_model(model_fn, config).to(world.device)
    piece = build_split(split, model, world=world, global_batch_size=config.global_batch_size,
                        micro_batches=micro_batches, schedule=schedule)
    optimizer = torch.optim.SGD(piece.module.parameters(), lr=config.lr)
    record = RunRecord(rank=world.rank, world_size=world.world_size, snapshots=[] if world.is_main else None)
    if world.is_main:
        record.initial = _float64(piece.full_state_dict())
    else:
        piece.full_state_dict()  # a collective: every rank joins
    source = BatchSource(data, config, device=world.device)
    for step in range(config.steps):
        X, y = source.batch(step)
        piece.zero_grad()
        loss_sum, _ = piece.forward_backward(X, y, global_batch_size=X.shape[0])
        grads = piece.full_grads()
        optimizer.step()
        params = piece.full_state_dict()
        record.batch_sizes.append(X.shape[0])
        record.shard_sizes.append(X.shape[0])
        record.example_digests.append(example_digests(X, y))
        record.losses.append(float(loss_sum) / X.shape[0] if piece.holds_output else float("nan"))
        record.param_digests.append(tensors_digest(list(params.values())))
        record.buffer_digests.append(tensors_digest([]))
        if world.is_main:
            record.snapshots.append({"grad": _float64(grads), "param": _float64(params), "buffer": {}})
    return record


def verify_split(model_fn, data, *, split: str, config: VerifyConfig, micro_batches: int | None = None,
                 schedule: str = "gpipe", title: str = "", log=None) -> VerifyReport:
    """Compare `split` on every k of config.world_sizes with 1-device training (cross-entropy, phalanx's rule)."""
    for k in config.world_sizes:
        check_split(split, model="lenet", num_devices=k, micro_batches=micro_batches,
                    global_batch_size=config.global_batch_size)
    reference = reference_run(model_fn, F.cross_entropy, data, config, device=torch.device(config.device))
    results = []
    for k in config.world_sizes:
        if log is not None:
            log(f"k = {k}: {config.steps} steps of --split {split} on {k} {config.device} workers")
        spec = LaunchSpec(plan=DevicePlan(names=tuple(f"{config.device}:{i}" for i in range(k))),
                          threads_per_device=config.threads_per_device, timeout_s=config.timeout_s,
                          deadline_s=config.deadline_s)
        ranks = launch(split_rank_worker, model_fn, data, replace(config, world_sizes=(k,)), split, micro_batches,
                       schedule, spec=spec)
        results.append(WorldResult(world_size=k, comparison=_compare(reference, ranks, rtol=config.rtol), split=split))
    return VerifyReport(config=config, results=results, title=title)


def _compare(reference: RunRecord, ranks: list[RunRecord], *, rtol: float) -> Comparison:
    main = ranks[0]
    steps = [compare_step(i + 1, got, want, rtol=rtol) for i, (got, want) in
             enumerate(zip(main.snapshots, reference.snapshots))]
    first = next((s.beyond[0] for s in steps if s.beyond), None)
    data_mismatch = next((f"step {i + 1}: rank {r.rank} did not see the whole 1-device batch"
                          for r in ranks for i, want in enumerate(reference.example_digests)
                          if r.example_digests[i] != want), None)
    scale = gradient_scale(main.snapshots[0]["grad"], reference.snapshots[0]["grad"]) if steps else None
    return Comparison(world_size=len(ranks), rtol=rtol, steps=steps, batch_sizes=list(reference.batch_sizes),
                      first_divergence=first, data_mismatch=data_mismatch, replica_mismatch=check_replicas(ranks),
                      gradient_scale=scale)
