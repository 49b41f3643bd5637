"""What a DDP user does by habit, without processes: `DataParallel` as an nn.Module
(state_dict without `module.`, DDP's keys accepted, moves after bucketing refused), the first
step's warnings (a loss that bypassed shard_loss, a padding DistributedSampler), running
statistics averaged bitwise-stably, `accumulate`, bf16-mixed precision, `evaluate_dataset`'s
guards, `reduce`, `world.print`, the run-script logger and progress bar, and the first line's
reason for `native` when ranks span hosts. The k-process side is
tests/distributed/test_ddp_habits_two_ranks.py."""

from __future__ import annotations

import dataclasses
import io
import re
import warnings
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import phalanx
from phalanx.comm import shm_applies
from phalanx.errors import UsageError
from phalanx.data_parallel.guards.first_step import FirstStepCheck, caller_frame
from phalanx.data_parallel.config import DataParallelConfig
from phalanx.data_parallel.prepare import Choices, prepare_replica
from phalanx.data_parallel.guards.sizes import SizesAcrossRanks
from phalanx.data_parallel.guards.running_stats import RunningStats, drifting_norm_layers
from phalanx.data_parallel.guards.step_extras import StepExtras
from phalanx.telemetry.metrics import read_metrics
from phalanx.runtime.world import World


def world(rank: int = 0, world_size: int = 1, local_world_size: int | None = None) -> World:
    return World(rank=rank, world_size=world_size, local_rank=rank % (local_world_size or world_size),
                 local_world_size=local_world_size or world_size, device=torch.device("cpu"),
                 backend="gloo" if world_size > 1 else "none", timeout_s=10.0)


def bn_net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


# --- case 5: DataParallel is an nn.Module -------------------------------------------------------

def test_data_parallel_is_the_model_as_far_as_torch_code_can_tell(tmp_path):
    torch.manual_seed(0)
    model = bn_net()
    dp = phalanx.DataParallel(model, world=world())
    assert isinstance(dp, nn.Module) and dp.module is model  # code using dp.module keeps working
    assert [p for p in dp.parameters()] == [p for p in model.parameters()]  # the same objects
    assert [n for n, _ in dp.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert [n for n, _ in dp.named_buffers()] == [n for n, _ in model.named_buffers()]
    assert list(dp.parameters(recurse=False)) == []
    dp.eval()
    assert not model.training and not model[1].training
    dp.train()
    assert model.training
    X = torch.randn(6, 4)
    assert torch.equal(dp(X), model(X))
    torch.save(dp.state_dict(), tmp_path / "model.pt")  # a DDP user's save, without .module
    plain = bn_net()
    plain.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))  # strict: same keys
    for (name, a), b in zip(model.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name
    assert dp.to("cpu") is dp and dp.float() is dp  # no-ops are fine
    dp.double()  # a world of one has no buckets: the plain module's .double()
    assert next(model.parameters()).dtype == torch.float64
    dp.close()


class _Generator(nn.Linear):
    def generate(self, n: int) -> int:
        return n


def test_a_method_of_the_wrapped_model_asked_of_the_replica_names_dp_module():
    # Before 2026-12-03 nanoGPT's dp.generate(...) gave torch's bare "has no attribute 'generate'".
    dp = phalanx.DataParallel(_Generator(2, 2), world=world())
    with pytest.raises(AttributeError, match=r"^'DataParallel' object has no attribute 'generate'; the model's own "
                                             r"attributes live on the wrapped model: dp.module.generate \(as DDP's "
                                             r"model.module\)$"):
        dp.generate(3)
    assert dp.module.generate(3) == 3 and not hasattr(dp, "generate")
    with pytest.raises(AttributeError, match=r"^'DataParallel' object has no attribute 'nothing'$"):
        dp.nothing
    dp.close()


def test_load_state_dict_takes_the_models_keys_and_ddps_prefixed_ones():
    torch.manual_seed(1)
    source = bn_net()
    for _ in range(2):
        source(torch.randn(5, 4))  # running statistics and num_batches_tracked move
    dp = phalanx.DataParallel(bn_net(), world=world())
    ddp_keys = {f"module.{k}": v for k, v in source.state_dict().items()}
    assert not dp.load_state_dict(ddp_keys).missing_keys
    for name, value in source.state_dict().items():
        assert torch.equal(dp.state_dict()[name], value), name
    with pytest.raises(RuntimeError, match="Unexpected key"):  # strict stays strict
        dp.load_state_dict({**source.state_dict(), "extra": torch.zeros(1)})

    class Holder(nn.Module):  # a model whose own child is called "module" keeps its keys
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)

    holder = phalanx.DataParallel(Holder(), world=world())
    assert list(holder.state_dict()) == ["module.weight", "module.bias"]
    holder.load_state_dict({"module.weight": torch.ones(2, 2), "module.bias": torch.zeros(2)})
    assert torch.equal(holder.module.module.weight, torch.ones(2, 2))


def test_moving_the_parameters_after_bucketing_is_refused_before_anything_moves():
    with phalanx.DataParallel(nn.Linear(3, 2), world=world(), options=DataParallelConfig(exchange_alone=True)) as dp:
        weight = dp.module.weight
        assert dp.to(torch.float32) is dp and dp.cpu() is dp
        for convert in (lambda: dp.double(), lambda: dp.to(torch.float16), lambda: dp.half()):
            with pytest.raises(ValueError, match=r"moving, casting or re-laying-out the replica's parameters \(weight"):
                convert()
        assert dp.module.weight is weight and weight.dtype == torch.float32
        with pytest.raises(ValueError, match=r"assign=True\) would replace the parameters"):
            dp.load_state_dict(dp.state_dict(), assign=True)


def test_a_world_of_one_builds_none_of_the_checks():
    dp = phalanx.DataParallel(bn_net(), world=world())
    extras = dp._extras
    assert (extras.first_step, extras.running_stats, extras.divide_by) == (None, None, None)
    loss = sum(p.sum() for p in dp.parameters())
    assert phalanx.shard_loss(loss, 1)._backward_hooks is None  # shard_loss registers no hook: the plain loop's step
    dp.close()


# --- case 2: a loss that did not come through shard_loss ----------------------------------------

def _first_step(loss_fn, *, sampler_loader=None) -> list[str]:
    """Rank 0's check of a 2-rank replica (no process needed: it never communicates)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    check = FirstStepCheck(list(model.parameters()), world_size=2, check_loss=True)
    X, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    loader = sampler_loader  # noqa: F841 - what the frame search finds, as in a user's loop
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not check.after_sync(caller_frame(0))  # no backward yet: not done
        loss_fn(model(X), y).backward()
        assert check.after_sync(caller_frame(0))
    assert check._handles == []  # done: nothing watches, shard_loss registers no hook
    assert phalanx.shard_loss(F.cross_entropy(model(X), y, reduction="sum"), 8)._backward_hooks is None
    return [str(w.message) for w in caught if issubclass(w.category, phalanx.PhalanxWarning)]


def test_a_mean_loss_is_named_once_with_the_fix_and_shard_loss_is_not():
    messages = _first_step(lambda out, y: F.cross_entropy(out, y))
    assert messages == [
        "this step's backward did not come through phalanx.shard_loss: gradients are summed over the 2 ranks, so "
        "a per-rank mean loss gives 2x the 1-device gradient (with SGD: the run with lr x 2); backpropagate "
        "phalanx.shard_loss(loss_sum, global_batch_size), or build the replica with average=True for DDP's mean "
        "of per-rank means (exact only for equal shards)"]
    assert _first_step(lambda out, y: phalanx.shard_loss(F.cross_entropy(out, y, reduction="sum"), 8)) == []
    # Through shard_loss and on: still its gradient that flows.
    assert _first_step(lambda out, y: 2 * phalanx.shard_loss(F.cross_entropy(out, y, reduction="sum"), 16)) == []


def _warned_at_first_step(model: nn.Module, loss_sum, global_batch_size: int) -> list[str]:
    """Rank 0's check of a 2-rank replica of `model` after one backward of
    `shard_loss(loss_sum(), global_batch_size)`: the PhalanxWarnings it gave."""
    check = FirstStepCheck(list(model.parameters()), world_size=2, check_loss=True, module=model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        phalanx.shard_loss(loss_sum(), global_batch_size).backward()
        assert check.after_sync(caller_frame(0))
    return [str(w.message) for w in caught if issubclass(w.category, phalanx.PhalanxWarning)]


def test_shard_loss_given_the_shards_own_size_is_named_once_and_the_global_size_is_not():
    # Before 2026-12-02 shard_loss(loss_sum, len(x)) trained 2 workers 0.56 relative away from one device, silently.
    def first_step(global_batch_size: int, rows: int = 8) -> list[str]:
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        X, y = torch.randn(rows, 4), torch.randint(0, 3, (rows,))
        return _warned_at_first_step(model, lambda: F.cross_entropy(model(X), y, reduction="sum"), global_batch_size)

    assert first_step(8) == [
        "phalanx.shard_loss got global_batch_size=8, the number of examples this rank's forward just saw: the "
        "global batch size is their sum over the 2 ranks (ShardedLoader yields it beside each shard); divided by "
        "the shard's own size the summed gradient is about 2x the 1-device gradient"]
    assert first_step(16) == [] and first_step(15) == []
    assert first_step(1, rows=1) == []  # fewer examples than ranks: one rank may hold them all


def _sizes_at_step_1(model: nn.Module, forward_and_loss, global_batch_size, rank_1_row=None,
                     same_batch: bool = False) -> list[str]:
    """Rank 0's SizesAcrossRanks of a 2-rank replica after one `shard_loss(forward_and_loss(), size)`
    and its comparison: its messages. Rank 1's row is rank 0's (equal shards, the same habit) but
    for its first batch (unless `same_batch`), or `rank_1_row`."""
    sizes = SizesAcrossRanks(model, world_size=2)
    phalanx.shard_loss(forward_and_loss(), global_batch_size).backward()

    def allreduce(flat, tag):  # the sum of the two ranks' rows, each filled in its own place
        rows = flat.view(2, -1)
        rows[1] = rows[0] if rank_1_row is None else torch.tensor(rank_1_row, dtype=flat.dtype)
        rows[1, 6] += 0 if same_batch else 1
    messages, going_on = sizes.after_step(allreduce, rank=0, device=torch.device("cpu"))
    sizes.close()
    return messages


def test_shard_loss_given_every_ranks_own_token_count_is_named_once():
    """A language model's `shard_loss(loss_sum, ids.numel())` on every rank: k times the gradient."""
    def first_step(global_batch_size, length: int = 6, masked: int = 0, rank_1_row=None) -> list[str]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(11, 4), nn.Linear(4, 11))
        ids = torch.randint(0, 11, (4, length))
        labels = ids.clone()
        labels[:, :masked] = -100
        return _sizes_at_step_1(model, lambda: F.cross_entropy(model(ids).flatten(0, 1), labels.flatten(),
                                                                reduction="sum"), global_batch_size, rank_1_row)

    assert first_step(24) == [
        "phalanx.shard_loss got global_batch_size=24 at synced step 1, on every rank the number of tokens that "
        "rank's forward just saw, all of them in the loss: the global count is their sum over the 2 ranks "
        "(phalanx.reduce(this rank's count, world=world) sums it); divided by each rank's own count the summed "
        "gradient is about 2x the 1-device gradient"]
    assert first_step(48) == [] and first_step(8) == []  # the global tokens; the global examples
    assert first_step(8, length=2) == []  # 2 tokens a row on 2 ranks: 8 is also the global examples, not judged
    # Before 2026-12-03 both were named as the habit on rank 0 alone, and obeying trained wrong:
    # an SFT loss on the second half of every sequence, 2 ranks: the global count of real tokens is 24.
    assert first_step(torch.tensor(24), masked=3) == []
    # One row on 2 ranks: rank 1's shard is empty (no calls of its own counted tokens), 24 is global.
    assert first_step(24, rank_1_row=[1, 24, 24 * 24, 0, 24, 0, 0, 0]) == []


def test_every_rank_given_the_same_first_token_batch_is_noted_once():
    """nanoGPT's get_batch() with one seed on every rank: k ranks train on one batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 4), nn.Linear(4, 11))
    ids = torch.randint(0, 11, (4, 6))

    def loss_sum():
        return F.cross_entropy(model(ids).flatten(0, 1), ids.flatten(), reduction="sum")
    assert _sizes_at_step_1(model, loss_sum, 48, same_batch=True) == [
        "every rank's first forward got the same 24 token ids: the 2 ranks train on one batch, 1/2 of the data a "
        "global batch holds (nanoGPT's get_batch() seeded alike on every rank); draw each rank's batch with its own "
        "seed (torch.manual_seed(seed + world.rank)) or shard one global batch (phalanx.ShardedLoader, "
        "phalanx.rank_shard)"]
    assert _sizes_at_step_1(model, loss_sum, 48) == []  # a batch of each rank's own
    # A prompt sampled under no_grad (the same on every rank by design) is not the training batch.
    sizes = SizesAcrossRanks(model, world_size=2)
    model(ids)
    trained = list(sizes.first_tokens)
    with torch.no_grad():
        model(torch.zeros(1, 1, dtype=torch.long))
    assert sizes.first_tokens == trained and trained[0] == 24
    sizes.close()


def test_shard_loss_registers_a_hook_only_while_a_check_waits():
    loss = nn.Parameter(torch.ones(()))  # the parameter the check waits on, which the loss comes from
    assert phalanx.shard_loss(loss * 3, 3)._backward_hooks is None
    check = FirstStepCheck([loss], world_size=2, check_loss=True)
    assert phalanx.shard_loss(loss * 3, 3)._backward_hooks
    check.close()
    check.close()  # twice is fine
    assert phalanx.shard_loss(loss * 3, 3)._backward_hooks is None


def test_shard_loss_is_seen_below_a_longer_loss_and_mixed_precision_casts():
    from phalanx.models import LeNet

    with phalanx.prepare(LeNet(), world=world(), precision="bf16-mixed") as dp:
        check = FirstStepCheck(list(dp.module.parameters()), world_size=2, check_loss=True)
        X, y = torch.rand(8, 1, 28, 28), torch.randint(0, 10, (8,))
        loss_sum = F.cross_entropy(dp(X), y, reduction="sum", label_smoothing=0.1)
        phalanx.shard_loss(loss_sum, 8).backward()
        assert check.through_shard_loss == 1
        check.close()


def test_a_generator_s_loss_through_its_discriminator_is_seen_coming_through_shard_loss():
    """DCGAN: G's loss reaches G's parameters only through D's whole graph, whose are the nearest."""
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4))
    D = nn.Sequential(*[layer for _ in range(12) for layer in (nn.Linear(4, 4), nn.Tanh())], nn.Linear(4, 1))
    check_G = FirstStepCheck(list(G.parameters()), world_size=2, check_loss=True)
    check_D = FirstStepCheck(list(D.parameters()), world_size=2, check_loss=True)
    fake = G(torch.randn(8, 3))
    phalanx.shard_loss(D(fake.detach()).sum(), 8).backward()  # D's step: G not reached
    assert check_D.through_shard_loss == 1 and not check_G.backward_ran
    check_D.close()  # D's first synced step is done
    phalanx.shard_loss(D(fake).sum(), 8).backward()  # G's step, through D
    assert check_G.backward_ran and check_G.through_shard_loss == 1
    check_G.close()
    mean_G = FirstStepCheck(list(G.parameters()), world_size=2, check_loss=True)
    D(G(torch.randn(8, 3))).mean().backward()  # a mean loss through D: still named
    assert mean_G.backward_ran and mean_G.through_shard_loss == 0
    mean_G.close()


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_checkpointed_model_s_backward_through_shard_loss_is_seen(reentrant):
    """checkpoint(model, x, use_reentrant=True) lands every gradient in a backward nested in the loss's."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    X, y = torch.randn(6, 4, requires_grad=True), torch.randint(0, 3, (6,))
    for through_shard_loss in (True, False):
        check = FirstStepCheck(list(model.parameters()), world_size=2, check_loss=True)
        try:
            loss_sum = F.cross_entropy(checkpoint(model, X, use_reentrant=reentrant), y, reduction="sum")
            (phalanx.shard_loss(loss_sum, 12) if through_shard_loss else loss_sum / 6).backward()
            assert check.backward_ran and check.through_shard_loss == int(through_shard_loss)
        finally:
            check.close()  # a check left waiting would hook every later test's shard_loss


# --- case 3: torch's DistributedSampler -----------------------------------------------------------

def test_a_padding_distributed_sampler_in_the_loop_is_named():
    data = TensorDataset(torch.randn(999, 4), torch.randint(0, 3, (999,)))
    loader = DataLoader(data, batch_size=10, sampler=DistributedSampler(data, num_replicas=2, rank=0))
    messages = _first_step(lambda out, y: phalanx.shard_loss(F.cross_entropy(out, y, reduction="sum"), 8),
                           sampler_loader=loader)
    assert messages == [
        "torch's DistributedSampler pads the 999 examples to 1000 by repeating 1 so that 2 ranks get equal shares "
        "(as DDP does), so an epoch is not the 1-device epoch; use phalanx.ShardedLoader(dataset, world=world, "
        "global_batch_size=..., shuffle=True), which splits every global batch exactly, the last one unevenly"]
    from phalanx.data.loader import distributed_sampler_note
    even = TensorDataset(torch.zeros(10, 1))
    assert distributed_sampler_note(DistributedSampler(even, num_replicas=2, rank=1)) is None  # nothing repeated
    assert "drops 1 of the 999 examples (drop_last=True)" in distributed_sampler_note(
        DistributedSampler(data, num_replicas=2, rank=0, drop_last=True))
    assert distributed_sampler_note(DataLoader(data)) is None


def test_a_dataloader_where_a_dataset_belongs_is_refused_and_shuffle_works_as_dataloaders():
    data = TensorDataset(torch.arange(6.0).unsqueeze(1), torch.arange(6))
    loader = DataLoader(data, sampler=DistributedSampler(data, num_replicas=2, rank=0))
    with pytest.raises(ValueError, match="ShardedLoader takes a Dataset, got a DataLoader \\(with torch's "
                                         "DistributedSampler.*pass loader.dataset"):
        phalanx.ShardedLoader(loader, world=world(), global_batch_size=2)
    with pytest.raises(ValueError, match="DDP's batch_size is per rank: global = batch_size x world size"):
        phalanx.ShardedLoader(data, world=world(), global_batch_size=2, batch_size=1)
    ordered = phalanx.ShardedLoader(data, world=world(), global_batch_size=4, shuffle=False)
    assert [y.tolist() for (_, y), _ in ordered.epoch(3)] == [[0, 1, 2, 3], [4, 5]]
    with pytest.raises(ValueError, match="evaluate_dataset takes a Dataset, got a DataLoader"):
        phalanx.evaluate_dataset(nn.Linear(1, 2), loader, world=world())


# --- case 1: running statistics -------------------------------------------------------------------

def test_running_statistics_average_to_the_mean_of_the_ranks_and_agreeing_ones_stay_bitwise():
    torch.manual_seed(0)
    ranks = [nn.BatchNorm1d(5), nn.BatchNorm1d(5)]
    for r, layer in enumerate(ranks):
        for _ in range(2 * r + 2):  # different data and counts (2 and 4) on each "rank"
            layer(torch.randn(7, 5) * (r + 1) + r)
    before = [{k: v.clone() for k, v in layer.state_dict().items()} for layer in ranks]
    stats = [RunningStats([layer]) for layer in ranks]
    packed = [torch.cat([t.double().reshape(-1) for t in s.tensors]) for s in stats]
    for r, s in enumerate(stats):  # each rank's allreduce adds the other rank's packed values
        s.average(lambda flat, r=r: flat.add_(packed[1 - r]), 2)
    for name in ("running_mean", "running_var"):
        want = ((before[0][name].double() + before[1][name].double()) / 2).float()
        assert torch.equal(ranks[0].state_dict()[name], want) and torch.equal(ranks[1].state_dict()[name], want)
    assert ranks[0].num_batches_tracked.item() == ranks[1].num_batches_tracked.item() == 3  # (2 + 4) / 2
    agreed = {k: v.clone() for k, v in ranks[0].state_dict().items()}
    same = RunningStats([ranks[0]])
    for k in (2, 3, 8):  # k identical ranks: float64 sums of float32 values, exact; the mean is the value
        same.average(lambda flat, k=k: flat.mul_(k), k)
        for name, value in ranks[0].state_dict().items():
            assert torch.equal(value, agreed[name]), (k, name)


def test_sync_layers_and_norms_without_statistics_are_left_alone():
    from phalanx.data_parallel import SyncBatchNorm
    model = nn.Sequential(nn.BatchNorm2d(3), nn.LayerNorm(3), nn.BatchNorm1d(3, track_running_stats=False),
                          nn.InstanceNorm1d(3, track_running_stats=True),
                          SyncBatchNorm(3, world=world()))
    assert drifting_norm_layers(model) == [model[0], model[3]]


def test_batchnorm_layers_the_sync_policy_never_converted_get_one_notice_naming_the_choices():
    with pytest.warns(phalanx.PhalanxWarning) as caught:  # a replica built without prepare, which converts them
        StepExtras(bn_net(), world=world(0, 2), average=None, average_running_stats=True, batchnorm="sync").close()
    assert caught[0].filename == __file__  # the caller's line, not StepExtras'
    assert [str(w.message) for w in caught] == [
        "1 BatchNorm layer(s) normalize with each of the 2 devices' own shard (policy local; their running statistics "
        "are averaged across ranks after every step); for the whole global batch's statistics build the replica "
        "with phalanx.prepare(model, world=world, batchnorm=\"sync\"), or pass batchnorm=\"local\" to keep this and "
        "silence the notice"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for rank, policy in ((0, "local"), (1, "sync")):  # local asked for, or another rank: silent
            StepExtras(bn_net(), world=world(rank, 2), average=None, average_running_stats=True,
                       batchnorm=policy).close()
        converted = phalanx.convert_sync_batchnorm(bn_net(), world(0, 2))  # prepare's sync: nothing to say
        StepExtras(converted, world=world(0, 2), average=None, average_running_stats=True, batchnorm="sync").close()
    with pytest.raises(ValueError, match="average must be None, True or False, got 'mean'"):
        DataParallelConfig(average="mean")


def test_sparse_embeddings_get_no_notice_their_gradient_is_sparse_again_after_the_sum():
    model = nn.ModuleDict({"words": nn.Embedding(10, 2, sparse=True), "tags": nn.EmbeddingBag(5, 2, sparse=True)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        StepExtras(model, world=world(0, 2), average=None, average_running_stats=True, batchnorm="sync").close()


# --- case 9: accumulate, bf16-mixed --------------------------------------------------------------

def test_accumulate_syncs_only_the_last_micro_batch_and_sums_to_the_whole_batch_gradient():
    torch.manual_seed(0)
    X, y = torch.randn(10, 4, dtype=torch.float64), torch.randint(0, 3, (10,))
    whole = nn.Linear(4, 3).double()
    phalanx.shard_loss(F.cross_entropy(whole(X), y, reduction="sum"), 10).backward()
    alone = DataParallelConfig(exchange_alone=True)  # the buckets, as on each of k devices
    with phalanx.DataParallel(nn.Linear(4, 3).double(), world=world(), options=alone) as dp:
        dp.load_state_dict(whole.state_dict())
        dp.zero_grad()
        synced = []
        for X_micro, y_micro in dp.accumulate(list(zip(X.split(4), y.split(4)))):
            synced.append(dp.sync_enabled)
            phalanx.shard_loss(F.cross_entropy(dp(X_micro), y_micro, reduction="sum"), 10).backward()
        dp.finish_gradient_sync()
        assert synced == [False, False, True]
        for mine, want in zip(dp.parameters(), whole.parameters()):
            torch.testing.assert_close(mine.grad, want.grad, rtol=1e-13, atol=0)
        assert [i for i in dp.accumulate(3)] == [0, 1, 2] and list(dp.accumulate(iter([]))) == []
        for _ in dp.accumulate(5):
            break  # leaving early restores the setting
        assert dp.sync_enabled
        with pytest.raises(ValueError, match="accumulate\\(0\\): the number of micro-batches must be at least 1"):
            dp.accumulate(0)


class _ModelOutput(OrderedDict):
    """Hugging Face's ModelOutput in miniature: a dict whose items are attributes too."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        super().__setattr__(key, value)


@dataclasses.dataclass(frozen=True)
class _Outputs:
    logits: torch.Tensor
    hidden: tuple
    note: str = "kept"


class _Returns(nn.Module):
    def __init__(self, wrap) -> None:
        super().__init__()
        self.linear, self.wrap = nn.Linear(4, 3), wrap

    def forward(self, x):
        return self.wrap(self.linear(x))


@pytest.mark.parametrize("wrap, read", [
    (lambda y: _ModelOutput(logits=y, loss=None), lambda out: out.logits),
    (lambda y: _Outputs(logits=y, hidden=(y, y.argmax(1))), lambda out: out.hidden[0]),
    (lambda y: {"logits": y}, lambda out: out["logits"]),
], ids=["ModelOutput", "dataclass", "dict"])
def test_bf16_mixed_widens_outputs_inside_their_own_container_type(wrap, read):
    """Before: a dict subclass came back a plain dict (`out.logits` failed on Hugging Face's
    outputs) and a dataclass came back unwidened, in bfloat16."""
    with prepare_replica(_Returns(wrap), DataParallelConfig(precision="bf16-mixed", exchange_alone=True),
                         world=world()) as dp:
        out = dp(torch.randn(5, 4))
        assert type(out) is type(wrap(torch.zeros(1, 3)))
        assert read(out).dtype == torch.float32 and read(out).shape == (5, 3)
        if isinstance(out, _Outputs):
            assert out.hidden[1].dtype == torch.int64 and out.note == "kept"


def test_bf16_mixed_runs_forward_in_bfloat16_and_keeps_weights_gradients_and_exchange_float32():
    torch.manual_seed(0)
    seen = []
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model[0].register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    reference = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    reference.load_state_dict(model.state_dict())
    X, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    with prepare_replica(model, DataParallelConfig(precision="bf16-mixed", exchange_alone=True), world=world()) as dp:
        out = dp(X)
        assert seen == [torch.bfloat16] and out.dtype == torch.float32  # widened for the loss
        phalanx.shard_loss(F.cross_entropy(out, y, reduction="sum"), 32).backward()
        dp.finish_gradient_sync()
        assert {b.buffer.dtype for b in dp.buckets} == {torch.float32}
        assert {p.grad.dtype for p in dp.parameters()} == {torch.float32}
        assert "float32, bf16-mixed (autocast forward, float32 weights and gradients)" in dp.choices.describe()
        F.cross_entropy(reference(X), y, reduction="mean").backward()
        for mine, want in zip(dp.parameters(), reference.parameters()):  # bfloat16's 8 bits of mantissa
            torch.testing.assert_close(mine.grad, want.grad, rtol=0.05, atol=2e-3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="precision 'bf16-mixed' keeps float32 weights, but the model's are float64"):
        phalanx.prepare(model, world=world(), dtype="float64", precision="bf16-mixed")
    with pytest.raises(ValueError, match="precision 'fp8' is unknown; choose one of bf16-mixed"):
        phalanx.prepare(model, world=world(), precision="fp8")
    for theirs, ours in (("16-mixed", "use precision='bf16-mixed', or torch.autocast"), (16, "float16 autocast"),
                         ("bf16", "is precision='bf16-mixed' here"), ("64-true", "dtype='float64' with precision unset"),
                         ("32-true", "dtype='float32' with precision unset"), ("no", "dtype='float32'"),
                         ("bf16-true", "dtype='bfloat16'"), ("16-true", "dtype='float16'")):  # Fabric's, Accelerate's
        with pytest.raises(ValueError, match=rf"^precision {theirs!r} is .*{re.escape(ours)}"):
            phalanx.prepare(model, world=world(), precision=theirs)
    assert all(torch.equal(v, before[k]) and v.dtype == torch.float32 for k, v in model.state_dict().items())


# --- case 7: evaluate_dataset's default, reduce, world.print --------------------------------------

def test_evaluate_datasets_default_metric_refuses_what_is_not_logits():
    data = TensorDataset(torch.randn(12, 4), torch.randint(0, 3, (12,)))
    torch.manual_seed(0)
    logits = nn.Linear(4, 3)
    sums = phalanx.evaluate_dataset(phalanx.DataParallel(logits, world=world()), data, world=world(), batch_size=5)
    assert sums["count"] == 12 and 0 <= sums["correct"] <= 12
    cases = [(nn.Sequential(nn.Linear(4, 3), nn.Softmax(dim=1)), data, "look like probabilities"),
             (nn.Linear(4, 1), data, r"class logits \[batch, classes >= 2\].*got outputs \(5, 1\)"),
             (nn.Linear(4, 3), TensorDataset(torch.randn(12, 4), torch.rand(12)), "integer class labels, got torch.float32"),
             (nn.Linear(4, 3), TensorDataset(torch.randn(12, 4)), r"take \(inputs, labels\) batches")]
    for model, dataset, message in cases:
        with pytest.raises(ValueError, match=message + ".*pass sums="):
            phalanx.evaluate_dataset(model, dataset, world=world(), batch_size=5)


def test_reduce_and_world_print_in_a_world_of_one(capsys):
    loss = torch.tensor(1.25, requires_grad=True)
    assert phalanx.reduce(loss, op="sum", world=world()) == 1.25 and phalanx.reduce(3, world=world()) == 3.0
    vector = torch.tensor([1.0, 2.0])
    reduced = phalanx.reduce(vector, world=world())
    assert reduced.dtype == torch.float64 and reduced.tolist() == [1.0, 2.0] and reduced is not vector
    with pytest.raises(ValueError, match="reduce op 'avg' is unknown; choose one of mean, sum, max, min"):
        phalanx.reduce(1.0, op="avg", world=world())
    assert phalanx.reduce(2.5, op="max", world=world()) == 2.5 and phalanx.reduce(3, op="min", world=world()) == 3
    with pytest.raises(ValueError, match=r"reduce takes a number or a tensor \(or a tuple, list or dict of them\), got str"):
        phalanx.reduce("1", world=world())
    # Counts are summed exactly (a float64 sum would make 2**53 + 1 even), and complex is refused.
    assert phalanx.reduce(torch.tensor(2 ** 53 + 1), op="sum", world=world()) == 2 ** 53 + 1
    assert phalanx.reduce(2 ** 53 + 1, op="sum", world=world()) == 2 ** 53 + 1
    assert phalanx.reduce(torch.tensor([True, True, False]), op="sum", world=world()).tolist() == [1, 1, 0]
    with pytest.raises(ValueError, match="reduce takes real values, got a complex tensor; reduce torch.view_as_real"):
        phalanx.reduce(torch.tensor(1 + 2j), world=world())
    world(0, 2).print("from rank", 0, sep=" ")
    world(1, 2).print("from rank", 1)
    assert capsys.readouterr().out == "from rank 0\n"


# --- case 9: a run script's logger and progress bar -------------------------------------------------

def test_the_metrics_logger_writes_phalanx_trains_jsonl_on_rank_0_only(tmp_path):
    rows = [{"epoch": 1, "train_loss": 0.9, "test_acc": 0.5, "epoch_s": 1.5},
            {"epoch": 2, "train_loss": 0.7, "test_acc": 0.6, "epoch_s": 1.4}]
    with phalanx.MetricsLogger(tmp_path / "run", world=world(0, 2), tensorboard=False) as log:
        for row in rows:
            log.log(row)
    assert read_metrics(tmp_path / "run" / "metrics.jsonl") == rows
    with phalanx.MetricsLogger(tmp_path / "other", world=world(1, 2), tensorboard=False) as log:
        log.log(rows[0])
    assert not (tmp_path / "other").exists() and log.rows == []
    resumed = phalanx.MetricsLogger(tmp_path / "run", world=world(0, 2), tensorboard=False, start_epoch=1)
    resumed.log({"epoch": 2, "train_loss": 0.65})
    assert [r["train_loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [0.9, 0.65]


def _has_tensorboard() -> bool:
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _has_tensorboard(), reason="the optional tensorboard package is not installed")
def test_the_metrics_logger_writes_tensorboard_events_when_tensorboard_is_installed(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    with phalanx.MetricsLogger(tmp_path, world=world(), tensorboard=True) as log:
        log.log({"epoch": 1, "train_loss": 0.9, "devices": ["cpu:0"]})
        log.log({"epoch": 2, "train_loss": 0.7, "devices": ["cpu:0"]})
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("train_loss")] == [(1, 0.9), (2, 0.7)]


@pytest.mark.skipif(_has_tensorboard(), reason="tensorboard is installed: nothing to refuse")
def test_asking_for_tensorboard_without_it_is_one_line_naming_the_extra(tmp_path):
    with pytest.raises(UsageError, match=r"tensorboard=True but the tensorboard package is not installed; "
                                         r"pip install 'phalanx\[tensorboard\]'"):
        phalanx.MetricsLogger(tmp_path, world=world(), tensorboard=True)
    phalanx.MetricsLogger(tmp_path, world=world()).log({"epoch": 1})  # the default: JSONL only
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"epoch": 1}]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_yields_every_item_and_draws_on_rank_0s_terminal_only():
    for rank in (0, 1):
        stream = _Terminal()
        assert list(phalanx.progress(iter(range(5)), world=world(rank, 2), label="epoch 1", total=5,
                                     stream=stream)) == [0, 1, 2, 3, 4]
        drawn = stream.getvalue()
        assert ("epoch 1 [" in drawn and "5/5" in drawn) if rank == 0 else drawn == ""
    assert list(phalanx.progress([7, 8], world=world(), stream=io.StringIO())) == [7, 8]  # not a terminal: silent


# --- case 6: the first line says which allreduce runs across hosts, and why -------------------------

def test_the_first_line_names_native_across_hosts_and_why():
    spanning = world(0, 2, local_world_size=1)
    choices = Choices(dtype="float64", batchnorm="sync", has_batchnorm=False, num_devices=2,
                      memory_format="contiguous", requested_algorithm="auto", algorithm="native",
                      fallback_reason=None, exchanging=True, overlap=True, bucket_kb=(4.0,), grad_dtype=None,
                      backend="gloo", why_not_shm=shm_applies(spanning))
    assert choices.describe().startswith(
        "allreduce native = gloo's own allreduce (auto: the shm allreduce serves the workers of one host; 2 ranks "
        "span hosts (1 per host)), overlapped gradient exchange")


def test_copying_or_pickling_the_replica_is_one_line_naming_the_model_inside():
    """AveragedModel(dp) (an EMA), copy.deepcopy(dp) and torch.save(dp) failed with "cannot pickle
    memoryview objects"; the model inside copies and saves as ever."""
    import copy
    import pickle

    with prepare_replica(nn.Linear(4, 2), DataParallelConfig(exchange_alone=True), world=world()) as dp:
        for attempt in (lambda: copy.deepcopy(dp), lambda: pickle.dumps(dp), lambda: torch.save(dp, io.BytesIO()),
                        lambda: torch.optim.swa_utils.AveragedModel(dp)):
            with pytest.raises(TypeError, match=r"^a DataParallel replica cannot be copied or pickled: .*"
                                                r"AveragedModel\(dp\.module\)"):
                attempt()
        ema = torch.optim.swa_utils.AveragedModel(dp.module)
        ema.update_parameters(dp.module)
        assert torch.equal(ema.module.weight, dp.module.weight)
        assert torch.equal(pickle.loads(pickle.dumps(dp.module)).weight, dp.module.weight)
