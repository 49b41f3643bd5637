"""Sharded data parallelism in one process: the flat layout, the optimizer's rules, the refusals.

The layout is pure arithmetic; the rest runs a replica in a world of one with an AsyncComm handed
in (the whole sharded machinery, every collective a no-op), against a plain replica. The
3-rank equivalences are tests/distributed/test_sharded_equals_one_device.py's.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from phalanx.data_parallel import DataParallelConfig, build_buckets, prepare, prepare_replica
from phalanx.data_parallel.sharding.flat_layout import FlatLayout, parameter_names
from phalanx.data_parallel.sharding.optim import check_elementwise
from phalanx.data_parallel.step import shard_loss
from phalanx.errors import UsageError
from phalanx.models import LeNet
from phalanx.runtime.world import World
from tests.unit.even_split import assert_even_split

WORLD1 = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
               backend="none", timeout_s=10.0)


def _layout(model: nn.Module, cap_bytes: int | None, k: int) -> FlatLayout:
    return FlatLayout(build_buckets(list(model.parameters()), cap_bytes=cap_bytes), names=parameter_names(model),
                      world_size=k)


def test_the_flat_order_depends_neither_on_k_nor_on_the_bucket_cap():
    model = LeNet().to(memory_format=torch.channels_last)
    layouts = [_layout(model, cap, k) for cap in (None, 4096, 256 * 1024) for k in (1, 2, 3, 5)]
    orders = {tuple((s.name, s.offset, s.numel, s.stride) for s in layout.slots) for layout in layouts}
    assert len(orders) == 1  # one order for every k and cap
    slots = layouts[0].slots
    assert [s.name for s in slots][:2] == ["fc2.bias", "fc2.weight"]  # reverse registration: backward's order
    assert slots[-1].name == "conv1.weight" and slots[-1].stride != (25, 25, 5, 1)  # memory order (channels_last)
    assert sum(s.numel for s in slots) == layouts[0].total == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("k", [1, 2, 3, 7])
def test_shards_are_contiguous_even_and_bucket_counts_add_up(k):
    layout = _layout(LeNet(), 64 * 1024, k)
    shards = [layout.shard(rank) for rank in range(k)]
    assert shards[0][0] == 0 and shards[-1][1] == layout.total
    assert all(a[1] == b[0] for a, b in zip(shards, shards[1:]))
    assert_even_split([hi - lo for lo, hi in shards], layout.total, k)
    for bucket, (start, stop) in enumerate(layout.bucket_ranges):
        counts = layout.counts(bucket)
        assert sum(counts) == stop - start
        owned = [layout.owned(bucket, rank) for rank in range(k)]
        assert [hi - lo for lo, hi in owned] == counts
    pieces = [p for rank in range(k) for p in layout.pieces(*layout.shard(rank))]
    assert sum(p.numel for p in pieces) == layout.total  # every element in exactly one piece


def test_optimizers_that_need_a_whole_tensor_are_refused_and_elementwise_ones_pass():
    check_elementwise(torch.optim.AdamW, None)
    with pytest.raises(ValueError, match="LBFGS cannot run on a shard: its line search"):
        check_elementwise(torch.optim.LBFGS, None)

    class MyOptimizer(torch.optim.SGD):
        pass

    with pytest.raises(ValueError, match="pass elementwise=True"):
        check_elementwise(MyOptimizer, None)
    check_elementwise(MyOptimizer, True)


def _replica(shard: str, model: nn.Module | None = None, **options):
    """A replica sharded on one device: exchange_alone builds the buckets and the sharded exchange."""
    torch.manual_seed(0)
    return prepare_replica(model or LeNet(), DataParallelConfig(shard=shard, exchange_alone=True, **options),
                           world=WORLD1, dtype="float64")


def _train(dp, optimizer, steps: int = 3, micro: int = 1) -> None:
    generator = torch.Generator().manual_seed(3)
    for _ in range(steps):
        X = torch.randn(12, 1, 28, 28, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 10, (12,), generator=generator)
        optimizer.zero_grad()
        for index in dp.accumulate(micro):
            piece = slice(index * 12 // micro, (index + 1) * 12 // micro)
            shard_loss(F.cross_entropy(dp(X[piece]), y[piece], reduction="sum"), 12).backward()
        dp.finish_gradient_sync()
        optimizer.step()


@pytest.mark.parametrize("stage", ["optimizer", "gradients", "parameters"])
@pytest.mark.parametrize("micro", [1, 3])
def test_each_stage_trains_as_the_plain_replica_with_and_without_accumulation(stage, micro):
    plain = _replica("none")
    plain_opt = plain.optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.01)
    _train(plain, plain_opt, micro=micro)
    sharded = _replica(stage)
    sharded_opt = sharded.optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.01)
    _train(sharded, sharded_opt, micro=micro)
    want, got = plain.full_state_dict(), sharded.full_state_dict()
    # Not bitwise: a parameter inside a flat buffer sits at another address, and the BLAS and
    # oneDNN kernels round a few products differently there (~4e-17 in the first forward).
    assert max(((got[k] - want[k]).abs().max() / want[k].abs().max()).item() for k in want) < 1e-12
    assert "sharded (ZeRO-" in sharded.choices.describe()


def test_a_torch_optimizer_over_a_sharded_replicas_parameters_is_refused():
    dp = _replica("optimizer")
    X, y = torch.randn(4, 1, 28, 28, dtype=torch.float64), torch.randint(0, 10, (4,))
    # A dp.optimizer's verdict (allowed) is not kept past its life: a later optimizer at its
    # address must be judged on its own.
    allowed = dp.optimizer(torch.optim.SGD, lr=0.1)
    shard_loss(F.cross_entropy(dp(X), y, reduction="sum"), 4).backward()
    dp.finish_gradient_sync()
    allowed.step()
    assert len(dp.sharding._guard._seen) == 1
    del allowed
    gc.collect()
    assert len(dp.sharding._guard._seen) == 0
    dp.zero_grad()
    optimizer = torch.optim.SGD(dp.parameters(), lr=0.1)
    shard_loss(F.cross_entropy(dp(X), y, reduction="sum"), 4).backward()
    dp.finish_gradient_sync()
    with pytest.raises(RuntimeError, match=r"build it with dp.optimizer\(SGD, \.\.\.\) instead of SGD\(dp.parameters"):
        optimizer.step()
    dp.close()


def test_stage_three_keeps_no_whole_parameter_at_rest_and_loads_and_gives_its_state():
    dp = _replica("parameters")
    at_rest = lambda: all(p.stride() == (0,) * p.dim() and p.numel() > 0 for p in dp.module.parameters())  # noqa: E731
    assert at_rest()  # their shapes, no memory: this rank keeps its range only
    with pytest.raises(RuntimeError, match=r"call dp.full_state_dict\(\) on every rank"):
        dp.module.state_dict()
    torch.manual_seed(5)
    other = LeNet().double().state_dict()
    dp.load_state_dict(other)
    got = dp.full_state_dict()
    assert all(torch.equal(got[k], other[k]) for k in other)
    assert at_rest()  # released again after the gather


def test_a_step_or_a_load_inside_gathered_parameters_is_a_usage_error():
    """Bad input, like a replaced .data: a UsageError (exit 2, one line), not a RuntimeError (a
    worker's failure with its traceback)."""
    dp = _replica("parameters")
    optimizer = dp.optimizer(torch.optim.SGD, lr=0.1)
    with dp.gathered_parameters():
        with pytest.raises(UsageError, match=r"^optimizer.step\(\) inside dp.gathered_parameters\(\): .*; step before"):
            optimizer.step()
        with pytest.raises(UsageError, match=r"^dp.load_state_dict\(\.\.\.\) inside dp.gathered_parameters\(\): "):
            dp.load_state_dict(dp.module.state_dict())
    optimizer.step()  # outside the block: allowed


def test_shard_on_one_device_runs_as_none_and_says_so():
    dp = prepare(LeNet(), world=WORLD1, shard="gradients")
    assert dp.shard == "none" and dp.sharding is None
    assert "shard gradients not applied (one device: nothing to shard)" in dp.choices.describe()


def test_an_unknown_stage_is_one_line():
    with pytest.raises(ValueError, match="shard 'zero4' is unknown; choose one of none, optimizer, gradients, parameters"):
        prepare(LeNet(), world=WORLD1, shard="zero4")


@pytest.mark.parametrize("stage", ["optimizer", "gradients", "parameters"])
def test_each_stage_runs_bf16_mixed_and_compressed_exchanges_as_the_plain_replica(stage):
    def train(shard: str, **options) -> dict:
        torch.manual_seed(0)
        dp = prepare_replica(LeNet(), DataParallelConfig(shard=shard, exchange_alone=True, **options), world=WORLD1)
        optimizer = dp.optimizer(torch.optim.Adam, lr=1e-3)
        generator = torch.Generator().manual_seed(3)
        for _ in range(3):
            X, y = torch.randn(12, 1, 28, 28, generator=generator), torch.randint(0, 10, (12,), generator=generator)
            optimizer.zero_grad()
            shard_loss(F.cross_entropy(dp(X), y, reduction="sum"), 12).backward()
            dp.finish_gradient_sync()
            optimizer.step()
        return dp.full_state_dict()

    # float32, the same arithmetic with kernels at other addresses (~1e-7 apart); a bf16 wire rounds
    # the gradients to 8 bits, so such a difference can flip a rounding: up to bf16's 2^-7 apart.
    for options, bound in (({"precision": "bf16-mixed"}, 1e-5), ({"grad_dtype": "bf16"}, 2 ** -7)):
        want, got = train("none", **options), train(stage, **options)
        worst = max(((got[k] - want[k]).abs().max() / want[k].abs().max()).item() for k in want)
        assert worst < bound, (options, worst)


def test_a_torch_optimizers_zero_grad_on_a_sharded_replica_names_dp_optimizer_as_the_fix():
    dp = _replica("optimizer")  # stage 1 keeps whole gradient buckets, which .grad aliases
    X, y = torch.randn(4, 1, 28, 28, dtype=torch.float64), torch.randint(0, 10, (4,))
    optimizer = torch.optim.AdamW(dp.parameters(), lr=1e-3)  # the DDP habit
    optimizer.zero_grad()  # set_to_none: the views into the buckets are gone
    shard_loss(F.cross_entropy(dp(X), y, reduction="sum"), 4).backward()
    with pytest.raises(RuntimeError) as refused:
        dp.finish_gradient_sync()
    message = str(refused.value)
    assert "\n" not in message and "build the optimizer with dp.optimizer(torch.optim.AdamW, lr=...)" in message
    assert "DataParallel.zero_grad()" not in message  # not the fix here
    dp.close()


def _train_then_add_a_group(dp, make, steps: int = 4) -> None:
    """The first two parameters (in the module's order) train from the start; the rest join as a
    second group with their own lr after the first step, as a backbone unfrozen mid-run."""
    params = list(dp.module.parameters())
    optimizer = make(params[:2])
    generator = torch.Generator().manual_seed(3)
    for step in range(steps):
        X = torch.randn(12, 1, 28, 28, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 10, (12,), generator=generator)
        optimizer.zero_grad()
        shard_loss(F.cross_entropy(dp(X), y, reduction="sum"), 12).backward()
        dp.finish_gradient_sync()
        optimizer.step()
        if step == 0:
            optimizer.add_param_group({"params": params[2:], "lr": 2e-3})
    return optimizer


@pytest.mark.parametrize("stage", ["optimizer", "gradients", "parameters"])
def test_a_param_group_added_mid_run_trains_its_pieces_as_the_plain_replica(stage):
    # Before 2026-12-04 add_param_group handed a sharded optimizer the whole parameters: at stages 2
    # and 3 they had no gradient and never trained (silently; 0.16 relative off after 4 steps here),
    # and at stage 1 its zero_grad dropped their bucket views and the sync refused the optimizer as
    # one "built over dp.parameters()", naming dp.optimizer, which it was.
    plain = _replica("none")
    _train_then_add_a_group(plain, lambda params: plain.optimizer(torch.optim.AdamW, params, lr=1e-3))
    sharded = _replica(stage)
    optimizer = _train_then_add_a_group(sharded, lambda params: sharded.optimizer(torch.optim.AdamW, params, lr=1e-3))
    want, got = plain.full_state_dict(), sharded.full_state_dict()
    assert max(((got[k] - want[k]).abs().max() / want[k].abs().max()).item() for k in want) < 1e-12
    whole = {id(p) for p in sharded.module.parameters()}
    assert not any(id(p) in whole for group in optimizer.param_groups for p in group["params"])  # pieces only
    assert [group["lr"] for group in optimizer.param_groups] == [1e-3, 2e-3]
    with pytest.raises(ValueError, match="more than one parameter group"):
        optimizer.add_param_group({"params": list(sharded.module.parameters())[:1]})
    sharded.close()


@pytest.mark.parametrize("stage", ["optimizer", "gradients", "parameters"])
def test_a_grad_scaler_unscales_a_sharded_optimizers_gradients_as_the_plain_replicas(stage):
    # Before 2026-12-04 unscale_ came before the step pre-hook that attaches each piece's gradient,
    # which optimizer.zero_grad() (set_to_none) had let go of: torch found no gradient and its step
    # failed with a bare "AssertionError: No inf checks were recorded for this optimizer."
    def run(dp):
        optimizer = dp.optimizer(torch.optim.SGD, lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        generator = torch.Generator().manual_seed(3)
        for _ in range(3):
            X = torch.randn(12, 1, 28, 28, generator=generator, dtype=torch.float64)
            y = torch.randint(0, 10, (12,), generator=generator)
            optimizer.zero_grad()
            scaler.scale(shard_loss(F.cross_entropy(dp(X), y, reduction="sum"), 12)).backward()
            dp.finish_gradient_sync()
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
        return dp.full_state_dict()

    want, got = run(_replica("none")), run(sharded := _replica(stage))
    assert max(((got[k] - want[k]).abs().max() / want[k].abs().max()).item() for k in want) < 1e-12
    sharded.close()


@pytest.mark.parametrize("stage", ["optimizer", "gradients", "parameters"])
def test_a_grad_scalers_unscale_before_the_sync_is_refused_for_a_sharded_optimizer(stage):
    # Its pieces are no module parameters, so the replica's guard never saw them (before 2026-12-04
    # unscale_ read this rank's unsummed range, racing the exchange where buckets went out in backward).
    from phalanx.data_parallel.guards.unscale import UnscaleBeforeSync

    dp = _replica(stage)
    optimizer = dp.optimizer(torch.optim.SGD, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    X, y = torch.randn(4, 1, 28, 28, dtype=torch.float64), torch.randint(0, 10, (4,))
    scaler.scale(shard_loss(F.cross_entropy(dp(X), y, reduction="sum"), 4)).backward()
    with pytest.raises(UnscaleBeforeSync, match=r"call dp.finish_gradient_sync\(\) right after"):
        scaler.unscale_(optimizer)
    dp.finish_gradient_sync()
    scaler.unscale_(optimizer)  # after the sync: torch's own
    dp.close()


@pytest.mark.parametrize("stage", ["none", "optimizer", "parameters"])
def test_clip_grad_norm_takes_torch_s_error_if_nonfinite_and_foreach(stage):
    # A port of torch.nn.utils.clip_grad_norm_(params, 1.0, error_if_nonfinite=True, foreach=True)
    # met "got an unexpected keyword argument"; now both are torch's, sharded or not.
    from phalanx import clip_grad_norm_, clip_grad_value_

    dp = _replica(stage)
    optimizer = dp.optimizer(torch.optim.SGD, lr=0.1)
    X = torch.randn(4, 1, 28, 28, dtype=torch.float64)
    optimizer.zero_grad()
    shard_loss(F.cross_entropy(dp(X), torch.tensor([0, 1, 2, 3]), reduction="sum"), 4).backward()
    dp.finish_gradient_sync()
    finite = clip_grad_norm_(dp, 1e9, error_if_nonfinite=True, foreach=True)
    assert torch.isfinite(finite) and finite > 0
    clip_grad_value_(dp, 1e9, foreach=False)
    grads = dp.sharding.shard_grads if dp.sharding is not None else [p.grad for p in dp.module.parameters()]
    grads[0].view(-1)[0] = float("inf")
    with pytest.raises(RuntimeError, match="non-finite|cannot be clipped"):
        clip_grad_norm_(dp, 1.0, error_if_nonfinite=True)
    assert clip_grad_norm_(dp, 1.0).isinf()  # torch's default: scaled by it, no error


def test_a_plain_optimizer_given_the_whole_parameters_later_by_add_param_group_is_refused_too():
    # Its verdict was taken once, at its first step, over a parameter of its own; a group added
    # after (the replica's whole parameters) stepped them with only this rank's range summed.
    dp = _replica("optimizer")
    other = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    optimizer = torch.optim.SGD([other], lr=0.1)
    X, y = torch.randn(4, 1, 28, 28, dtype=torch.float64), torch.tensor([0, 1, 2, 3])
    other.grad = torch.ones_like(other)
    optimizer.step()  # not the replica's: allowed
    optimizer.add_param_group({"params": list(dp.parameters())})
    shard_loss(F.cross_entropy(dp(X), y, reduction="sum"), 4).backward()
    dp.finish_gradient_sync()
    with pytest.raises(RuntimeError, match=r"build it with dp.optimizer\(SGD, \.\.\.\)"):
        optimizer.step()
    dp.close()
