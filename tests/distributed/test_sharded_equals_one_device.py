"""Sharded data parallelism (ZeRO stages 1-3) equals `shard="none"` and 1 device, float64.

One spawn of 3 workers and one run in this process (a world of one) train the same models from
the same seed, each rank on its `split_batch` shard of the same global batches of 13 (shards of
5, 4, 4: uneven), with `dp.optimizer(...)`: SGD, momentum SGD (with weight decay), Adam and AdamW
(weight decay), gradient clipping by the global norm on, for every stage. Parameters must end
within 1e-9 relative of the 1-device run and of `shard="none"`, bitwise identical on every rank;
the optimizer state, reassembled from the 3 ranks' shares (data_parallel/sharding/state.py: the very ranges a
checkpoint holds), within 1e-9 of the plain optimizer's. A small MLP adds a model whose buckets
hold whole Linear weights; LeNet-BN adds BatchNorm (sync) running statistics. The ring's and
the backend's (gloo) reduce-scatter and all-gather take LeNet with AdamW through every stage too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from phalanx.data import split_batch
from phalanx.data_parallel import prepare
from phalanx.data_parallel.clip import clip_grad_norm_
from phalanx.data_parallel.step import shard_loss
from phalanx.data_parallel.sharding.state import RangesReader, rank_state, trainable_names, whole_state
from phalanx.models import build_model
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

STEPS, GLOBAL_BATCH = 3, 13
STAGES = ("none", "optimizer", "gradients", "parameters")
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3}),
    "adam": (torch.optim.Adam, {"lr": 1e-3}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01}),
}
MODELS = ("lenet", "lenet-bn", "small-mlp")


def _model(name: str) -> nn.Module:
    if name == "small-mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    return build_model(name)


def _worker(world, stages) -> dict:
    generator = torch.Generator().manual_seed(7)
    batches = [(torch.randn(GLOBAL_BATCH, 1, 28, 28, generator=generator, dtype=torch.float64),
                torch.randint(0, 10, (GLOBAL_BATCH,), generator=generator)) for _ in range(STEPS)]
    results = {}
    for algorithm in ("ring", "native"):  # the other transports' reduce-scatter and all-gather, one case each
        for stage in stages:
            torch.manual_seed(0)
            with prepare(_model("lenet"), world=world, dtype="float64", shard=stage, algorithm=algorithm) as dp:
                optimizer = dp.optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.01)
                for X, y in batches:
                    X_shard, y_shard = split_batch(X, y, world.world_size)[world.rank]
                    optimizer.zero_grad()
                    shard_loss(F.cross_entropy(dp(X_shard), y_shard, reduction="sum"), GLOBAL_BATCH).backward()
                    dp.finish_gradient_sync()
                    optimizer.step()
                results[(algorithm, stage)] = dp.full_state_dict()
    for model_name in MODELS:
        for opt_name, (cls, kwargs) in OPTIMIZERS.items():
            for stage in stages:
                torch.manual_seed(0)
                with prepare(_model(model_name), world=world, dtype="float64", shard=stage) as dp:
                    optimizer = dp.optimizer(cls, **kwargs)
                    for X, y in batches:
                        X_shard, y_shard = split_batch(X, y, world.world_size)[world.rank]
                        optimizer.zero_grad()
                        loss_sum = F.cross_entropy(dp(X_shard), y_shard, reduction="sum")
                        shard_loss(loss_sum, GLOBAL_BATCH).backward()
                        dp.finish_gradient_sync()
                        clip_grad_norm_(dp, 0.5)
                        optimizer.step()
                    done = {"state": dp.full_state_dict(), "describe": dp.choices.describe()}
                    if dp.sharding is not None:
                        done["share"] = rank_state(dp, optimizer)
                        done["slots"] = dp.sharding.layout.slots
                    else:
                        done["optimizer"] = optimizer.state_dict()
                    done["names"] = trainable_names(dp.module)
                    results[(model_name, opt_name, stage)] = done
    return results


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item() if want.numel() else 0.0


def _worst(got: dict, want: dict) -> float:
    return max(_relative(got[k], want[k]) for k in want if torch.is_tensor(want[k]) and want[k].is_floating_point())


def test_every_stage_equals_shard_none_and_one_device_parameters_and_optimizer_state():
    one = run_workers(_worker, 1, ("none",))[0]
    three = run_workers(_worker, 3, STAGES, timeout_s=300)
    for algorithm in ("ring", "native"):
        for stage in STAGES:
            assert _worst(three[0][(algorithm, stage)], three[0][(algorithm, "none")]) < 1e-9, (algorithm, stage)
            assert _worst(three[2][(algorithm, stage)], three[0][(algorithm, stage)]) == 0.0, (algorithm, stage)
    for model_name in MODELS:
        for opt_name in OPTIMIZERS:
            reference = one[(model_name, opt_name, "none")]
            none = three[0][(model_name, opt_name, "none")]
            for stage in STAGES:
                case = (model_name, opt_name, stage)
                got = three[0][case]
                assert _worst(got["state"], reference["state"]) < 1e-9, case
                assert _worst(got["state"], none["state"]) < 1e-9, case
                for rank in (1, 2):
                    assert _worst(three[rank][case]["state"], got["state"]) == 0.0, (case, rank)
                if stage == "none":
                    continue
                assert f"sharded (ZeRO-{STAGES.index(stage)})" in got["describe"], got["describe"]
                shares = [three[rank][case]["share"] for rank in range(3)]
                reader = RangesReader([s["ranges"] for s in shares], lambda i: shares[i], shares[0]["groups"])
                params, optimizer_state = whole_state(reader, slots=got["slots"], names=got["names"])
                assert _worst(params, {n: none["state"][n] for n in params}) < 1e-9, case
                want = none["optimizer"]["state"]
                assert set(optimizer_state["state"]) == set(want), case
                # Relative to each state's largest value over all parameters: a conv bias under
                # BatchNorm has a zero gradient, and its Adam moments are rounding noise (~1e-18).
                scale = {}
                for entry in want.values():
                    for key, value in entry.items():
                        if torch.is_tensor(value) and value.is_floating_point() and value.dim():
                            scale[key] = max(scale.get(key, 0.0), value.abs().max().item())
                for index, entry in want.items():
                    for key, value in entry.items():
                        mine = optimizer_state["state"][index][key]
                        if key in scale:
                            assert (mine - value).abs().max().item() <= 1e-9 * scale[key], (case, index, key)
                        else:
                            assert float(mine) == float(value), (case, index, key)
                groups = none["optimizer"]["param_groups"]
                assert [g["params"] for g in optimizer_state["param_groups"]] == [g["params"] for g in groups]
                assert [g["lr"] for g in optimizer_state["param_groups"]] == [g["lr"] for g in groups]


def _layout_and_clip_worker(world) -> dict:
    """What a sharded replica does beside the exactness above: its parameters keep their layout
    (strides), and the clip's global norm goes through the replica's own exchange."""
    import phalanx.data_parallel.clip as clip

    generator = torch.Generator().manual_seed(3)
    X = torch.randn(8, 1, 28, 28, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 10, (8,), generator=generator)
    X_shard, y_shard = split_batch(X, y, world.world_size)[world.rank]
    results = {}
    for stage in ("none", "optimizer", "gradients"):
        torch.manual_seed(0)
        with prepare(build_model("lenet"), world=world, dtype="float64", shard=stage) as dp:
            results[("strides", stage)] = [tuple(p.stride()) for p in dp.module.parameters()]
            conv1 = next(m for m in dp.module.modules() if isinstance(m, nn.Conv2d))
            results[("conv1 out channels_last", stage)] = conv1(X_shard).is_contiguous(
                memory_format=torch.channels_last)
            shard_loss(F.cross_entropy(dp(X_shard), y_shard, reduction="sum"), 8).backward()
            dp.finish_gradient_sync()
            native = clip.native
            if stage != "none":  # gloo's call, which the 2-norm's sum must not take any more
                clip.native = lambda *args, **kwargs: (_ for _ in ()).throw(AssertionError("gloo called"))
            try:
                results[("norm 2", stage)] = clip.clip_grad_norm_(dp, 1e9).item()
            finally:
                clip.native = native
            results[("norm inf", stage)] = clip.clip_grad_norm_(dp, 1e9, norm_type=float("inf")).item()
    return results


def test_a_sharded_replica_keeps_the_layout_and_sums_the_clip_norm_through_its_exchange():
    """ZeRO-1/2 made each parameter a view into a flat buffer, with contiguous strides where
    is_contiguous() called both layouts the same: conv1's one-channel channels_last weight lost
    its layout, so its output came out contiguous and every layer after converted it back (1-2 ms
    of a 10 ms step on 2 cores). Its clip summed the norm with a gloo call (2 ms) where the
    replica's shm exchange takes ~15 us."""
    ranks = run_workers(_layout_and_clip_worker, 2)
    for rank in ranks:
        for stage in ("optimizer", "gradients"):
            assert rank[("strides", stage)] == rank[("strides", "none")], stage
            assert rank[("conv1 out channels_last", stage)], stage
            for norm in ("norm 2", "norm inf"):
                assert abs(rank[(norm, stage)] - rank[(norm, "none")]) <= 1e-12 * rank[(norm, "none")], (stage, norm)
    assert ranks[0] == ranks[1]
