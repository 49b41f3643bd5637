"""`phalanx.prepare` without processes: what it chooses for a CPU conv net and for an MLP, the
BatchNorm policy on one device, the one line that says so, that a world of one gets the plain
loop (its step bitwise the plain PyTorch step), the exchange options it passes on, that bad
names are refused before the model is touched, and a lazy module before its first forward too. The k-rank behaviour is
tests/distributed/test_prepare_equals_one_rank.py."""

from __future__ import annotations

import copy
import re
import sys
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import phalanx
from phalanx.models import LeNet, build_model
from phalanx.data_parallel import DataParallelConfig, SyncBatchNorm, apply_memory_format, prepare_replica
from phalanx.train import train_batch
from phalanx.runtime.world import World

WORLD1 = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
               backend="none", timeout_s=10.0)


def _conv_weights(module: nn.Module) -> list[torch.Tensor]:
    return [m.weight for m in module.modules() if isinstance(m, nn.Conv2d)]


def test_a_cpu_conv_net_gets_channels_last_and_the_first_line_says_what_was_chosen():
    with phalanx.prepare(LeNet(), world=WORLD1) as dp:
        weights = _conv_weights(dp.module)
        assert all(w.is_contiguous(memory_format=torch.channels_last) for w in weights)
        assert not weights[1].is_contiguous()  # conv2 (50, 20, 5, 5): NHWC, no longer NCHW (conv1's 1 channel is both)
        chose = dp.choices
        assert (chose.memory_format, chose.dtype, chose.algorithm, chose.has_batchnorm) == \
            ("channels_last", "float32", "native", False)
        assert chose.describe() == "no gradient exchange (one device), channels_last, float32"
    with phalanx.prepare(nn.Sequential(nn.Flatten(), nn.Linear(784, 10)), world=WORLD1, dtype="float64") as dp:
        assert (dp.choices.memory_format, dp.choices.dtype) == ("contiguous", "float64")
        assert next(dp.module.parameters()).dtype == torch.float64
    with phalanx.prepare(LeNet(), world=WORLD1, memory_format="contiguous") as dp:
        assert dp.choices.memory_format == "contiguous" and all(w.is_contiguous() for w in _conv_weights(dp.module))


@pytest.mark.parametrize("policy", ["sync", "local"])
def test_a_batchnorm_model_on_one_device_keeps_plain_batchnorm_under_either_policy(policy):
    with phalanx.prepare(build_model("lenet-bn"), world=WORLD1, batchnorm=policy) as dp:
        layers = [m for m in dp.module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        assert layers and not any(isinstance(m, SyncBatchNorm) for m in layers)  # one device sees the whole batch
        assert (dp.choices.batchnorm, dp.choices.has_batchnorm) == (policy, True)
        assert dp.choices.describe().endswith(f", BatchNorm {policy} (one device: plain BatchNorm sees the whole batch)")


def test_a_world_of_one_is_the_plain_loop_step_for_step():
    torch.manual_seed(0)
    X, y = torch.randn(24, 1, 28, 28, dtype=torch.float64), torch.randint(0, 10, (24,))
    torch.manual_seed(1)
    plain = apply_memory_format(LeNet().double(), torch.channels_last)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    torch.manual_seed(1)
    with phalanx.prepare(LeNet(), world=WORLD1, dtype=torch.float64) as dp:
        assert not dp.exchanging and dp.buckets == [] and dp._hook_handles == []
        optimizer = torch.optim.SGD(dp.module.parameters(), lr=0.1)
        for _ in range(3):
            train_batch(dp, optimizer, X, y, global_batch_size=24)
            plain_optimizer.zero_grad(set_to_none=True)
            (F.cross_entropy(plain(X), y, reduction="sum") / 24).backward()
            plain_optimizer.step()
        for (name, got), want in zip(dp.module.named_parameters(), plain.parameters()):
            assert torch.equal(got, want), name
        dp.zero_grad()
        assert all(p.grad is None for p in dp.module.parameters())  # as optimizer.zero_grad() leaves them


def test_the_exchange_options_reach_the_replica():
    # prepare's keywords build the replica's options, one object (a torch wire dtype by its name).
    with phalanx.prepare(LeNet(), world=WORLD1, grad_dtype=torch.bfloat16, algorithm="ring", shard="optimizer",
                         check_finite_every=7) as dp:
        assert dp.options == DataParallelConfig(grad_dtype="bf16", allreduce="ring", shard="optimizer",
                                                check_finite_every=7)
    # exchange_alone keeps the buckets a world of one leaves out, as on each of k devices.
    alone = DataParallelConfig(exchange_alone=True)
    with prepare_replica(LeNet(), replace(alone, grad_dtype="bf16", bucket_cap_mb=0.25), world=WORLD1) as dp:
        assert len(dp.buckets) == 3 and dp.grad_dtype is torch.bfloat16
        assert dp.choices.describe().startswith("allreduce native (auto), overlapped gradient exchange in 3 "
                                                "bucket(s) of [5.5, 400.0, 98.6] KB (cap 0.25 MB) sent as bf16, "
                                                "channels_last")
    # Without overlap one flat bucket, whatever the cap: nothing overlaps, so one call is fastest.
    with prepare_replica(LeNet(), replace(alone, overlap=False, bucket_cap_mb=0.01), world=WORLD1) as dp:
        assert len(dp.buckets) == 1 and dp.options.bucket_cap_mb is None and dp.choices.describe().startswith(
            "allreduce native (auto), synchronous gradient exchange in 1 bucket(s)")
    with prepare_replica(LeNet(), replace(alone, allreduce="ring"), world=WORLD1) as dp:
        assert dp.choices.describe().startswith("allreduce ring, ")


@pytest.mark.parametrize("kwargs, message", [
    ({"algorithm": "butterfly"}, "algorithm 'butterfly' is unknown; choose one of auto, native, shm"),
    ({"batchnorm": "global"}, "batchnorm 'global' is unknown; choose one of sync, local"),
    ({"memory_format": "nhwc"}, "memory_format 'nhwc' is unknown; choose one of auto, channels_last, contiguous"),
    ({"bucket_cap_mb": 0}, "bucket_cap_mb 0 must be a positive number of MB"),
    ({"shard": "optimizer", "algorithm": "tree"},
     "shard optimizer reduce-scatters and all-gathers, which algorithm tree cannot; use algorithm auto, shm, "
     "hierarchical, ring or native"),
    ({"dtype": "float8"}, "dtype 'float8' is unknown; choose one of float32, float64"),
    ({"grad_dtype": "int8"}, "grad_dtype 'int8' is unknown; choose one of bf16, fp16"),
    ({"grad_dtype": torch.float64}, "grad_dtype torch.float64 is not supported; use one of bf16, fp16"),
])
def test_bad_names_are_refused_before_the_model_is_touched(kwargs, message):
    model = LeNet()
    before = {k: (v.clone(), v.stride()) for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        phalanx.prepare(model, world=WORLD1, dtype=kwargs.pop("dtype", "float64"), **kwargs)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) and after[k].dtype == v.dtype and after[k].stride() == s
               for k, (v, s) in before.items())


def _mlp() -> nn.Module:  # no convolutions: inductor's conv gradients are wrong on this CPU (no AVX2)
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 16), nn.GELU(), nn.Linear(16, 3)).double()


def _compiled_steps(dp, model, model_zero_grad) -> list[torch.Tensor]:
    X, y = torch.randn(8, 2, dtype=torch.float64), torch.randint(0, 3, (8,))
    optimizer = torch.optim.AdamW(dp.parameters(), lr=0.01)
    for _ in range(2):
        model_zero_grad()
        F.cross_entropy(model(X), y).backward()
        dp.finish_gradient_sync()
        optimizer.step()
    return [p.detach().clone() for p in dp.parameters()]


def test_compile_before_or_after_prepare_trains_alike_and_a_sharded_one_compiled_after_is_refused():
    # backend="eager": dynamo traces as torch.compile does (what the check sees) without
    # inductor's code generation, which takes minutes on a busy 2-core machine.
    alone = DataParallelConfig(exchange_alone=True)  # the buckets, as on each of k devices
    with prepare_replica(torch.compile(_mlp(), backend="eager"), alone, world=WORLD1) as dp:
        assert dp.exchanging
        before = _compiled_steps(dp, dp, dp.zero_grad)
        assert not dp.compiled_after_prepare
    with prepare_replica(_mlp(), alone, world=WORLD1) as dp:
        compiled = torch.compile(dp, backend="eager")
        # nn.Module's zero_grad sets .grad to None: each gradient is taken back into its bucket as it lands
        after = _compiled_steps(dp, compiled, compiled.zero_grad)
        assert dp.compiled_after_prepare and all(torch.equal(a, b) for a, b in zip(before, after))
    with prepare_replica(_mlp(), replace(alone, shard="optimizer"), world=WORLD1) as dp:
        compiled = torch.compile(dp, backend="eager")
        with pytest.raises(phalanx.UsageError, match=r"the replica was compiled after prepare, and the compiled "
                           r"wrapper's zero_grad\(\) is nn.Module's, which drops the buckets; compile the model "
                           r"before prepare: dp = phalanx.prepare\(torch.compile\(model\), world=world\)$"):
            _compiled_steps(dp, compiled, compiled.zero_grad)
    torch._dynamo.reset()


@pytest.mark.parametrize("lazy, name, owner", [
    (lambda: nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 3)), "0.weight", "LazyLinear"),
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.LazyConv1d(2, 1)), "1.weight", "LazyConv1d"),
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.LazyBatchNorm1d()), "1.weight", "LazyBatchNorm1d"),
])
def test_a_lazy_module_before_its_first_forward_is_refused_naming_it_and_the_fix(lazy, name, owner):
    """DDP refuses them too; phalanx on every world size, so one device fails where k would."""
    message = rf"{name} is not initialized yet \({owner} infers its shape at the first forward\): run one forward"
    with pytest.raises(ValueError, match=message):
        phalanx.prepare(lazy(), world=WORLD1)
    with pytest.raises(ValueError, match=message):
        phalanx.DataParallel(lazy(), world=WORLD1)


def test_a_module_on_the_meta_device_is_refused_and_trains_once_materialized():
    with torch.device("meta"):  # deferred initialization, as torchtitan builds a model
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    for build in (phalanx.prepare, phalanx.DataParallel):
        with pytest.raises(ValueError, match=r"^0\.weight \(Linear\) is on the meta device and holds no values: "
                                             r"materialize the model before phalanx\.prepare, model\.to_empty"):
            build(model, world=WORLD1)
    model.to_empty(device="cpu")  # the fix the refusal names
    for layer in model:
        layer.reset_parameters()
    with phalanx.prepare(model, world=WORLD1) as dp:
        F.cross_entropy(dp(torch.randn(5, 4)), torch.tensor([0, 1, 2, 0, 1]), reduction="sum").backward()
        dp.finish_gradient_sync()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in dp.parameters())


def test_a_model_already_in_a_data_parallel_wrapper_is_refused_naming_the_model_inside():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # DDP needs a group
    try:
        cases = [(DDP(nn.Linear(4, 2)), "the model is already wrapped in torch's DistributedDataParallel", "module"),
                 (nn.DataParallel(nn.Linear(4, 2)), "the model is already wrapped in torch.nn.DataParallel", "module"),
                 (phalanx.prepare(nn.Linear(4, 2), world=WORLD1), "wrapped in a phalanx replica", "module"),
                 (nn.Sequential(nn.ReLU(), nn.DataParallel(nn.Linear(4, 2))),
                  "its submodule 1 is already wrapped in torch.nn.DataParallel", "1.module")]
        for wrapped, said, inside in cases:
            for build in (phalanx.prepare, phalanx.DataParallel):
                with pytest.raises(ValueError, match=rf"{re.escape(said)}.*pass the model itself "
                                                     rf"\({re.escape(inside)} of this one\) to phalanx\.prepare, once"):
                    build(wrapped, world=WORLD1)
    finally:
        dist.destroy_process_group()


def test_a_model_an_open_replica_holds_is_refused_until_that_one_is_closed():
    # A notebook cell `dp = phalanx.prepare(model, ...)` run twice, or a helper that prepares called
    # twice: before 2026-12-05 both replicas hooked the same gradients and on 2 ranks every
    # optimizer.step() was refused as "after a backward whose gradients were never summed" although
    # the script called finish_gradient_sync() (the older replica's never were).
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    first = phalanx.prepare(model, world=WORLD1); line = sys._getframe().f_lineno  # noqa: E702
    said = (rf"^the model's parameter {{}} is already exchanged by an open phalanx replica \(made at "
            rf"test_prepare\.py:{line}\), and a second would exchange it again: use that replica, or call its "
            rf"close\(\) first \(a notebook cell that prepares the model, run twice: dp\.close\(\), then run it\)$")
    for again, name in ((model, "0.weight"), (model[2], "weight"), (nn.Sequential(model, nn.Linear(2, 1)), "0.0.weight")):
        for build in (phalanx.prepare, phalanx.DataParallel):
            with pytest.raises(ValueError, match=said.format(re.escape(name))):
                build(again, world=WORLD1)
    other = phalanx.prepare(nn.Linear(4, 2), world=WORLD1)  # another model's replica: its own
    first.close()
    second = phalanx.prepare(model, world=WORLD1)  # closed: the model may be prepared again
    with pytest.raises(ValueError, match=said.format("weight").replace(str(line), r"\d+")):
        phalanx.prepare(model[0], world=WORLD1)
    second.close()
    other.close()


def test_a_lazy_module_after_a_dummy_forward_trains_as_the_plain_loop():
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 3)).double()
    X, y = torch.randn(6, 5, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1, 2])
    model(X[:1])  # the fix the refusal names
    plain = copy.deepcopy(model)
    with phalanx.prepare(model, world=WORLD1) as dp:
        for replica in (dp, plain):
            F.cross_entropy(replica(X), y, reduction="sum").backward()
        dp.finish_gradient_sync()
        for got, want in zip(dp.parameters(), plain.parameters()):
            assert torch.equal(got.grad, want.grad)
