"""The BatchNorm models (LeNet-BN, the small ResNet), the registry, and SyncBatchNorm on one process.

Shapes and parameter counts are checked against counts written out by hand from the layer
lists, so a changed architecture fails loudly. On one process SyncBatchNorm communicates nothing,
which makes its own arithmetic checkable here: against nn.BatchNorm and with gradcheck.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn.functional as F
import torch.utils._python_dispatch
from torch import nn

from phalanx.measure.mlp import BENCH_MODELS, WideMLP, build_bench_model
from phalanx.models import INITS, MODELS, LeNet, LeNetBN, ResNet, book_init, build_model, has_batchnorm
from phalanx.data_parallel import SyncBatchNorm, convert_sync_batchnorm, has_sync_batchnorm
from phalanx.data_parallel.sync_batchnorm import SyncBatchNormFunction, _Reducer, global_batch_stats
from phalanx.runtime.world import World

WORLD_1 = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
                backend="none", timeout_s=10.0)


def _conv(cin, cout, k):
    return cin * cout * k * k + cout


def _resnet_count():
    block = lambda cin, cout: _conv(cin, cout, 3) + _conv(cout, cout, 3) + 4 * cout + (  # noqa: E731
        _conv(cin, cout, 1) if cin != cout else 0)
    return _conv(1, 16, 3) + 32 + block(16, 16) + block(16, 32) + block(32, 64) + block(64, 128) + 128 * 10 + 10


PARAMS = {
    "lenet": 129_068,
    "lenet-bn": 129_068 + 2 * (20 + 50 + 128),
    "resnet": _resnet_count(),
    "mlp": 784 * 2048 + 2048 + 2048 * 2048 + 2048 + 2048 * 10 + 10,
}


def test_registry_names_shapes_and_parameter_counts():
    assert MODELS == ("lenet", "lenet-bn", "resnet", "mlp")
    assert set(BENCH_MODELS) <= set(MODELS)
    x = torch.rand(5, 1, 28, 28)
    for name in MODELS:
        for init in INITS:
            model = build_model(name, init=init, num_classes=7)
            assert model(x).shape == (5, 7), name
            if name != "mlp":
                assert sum(p.numel() for p in build_model(name).parameters()) == PARAMS[name], name
    assert sum(p.numel() for p in build_model("mlp").parameters()) == PARAMS["mlp"]
    assert PARAMS["resnet"] == 308_810  # "a few hundred thousand"
    assert isinstance(build_model("lenet-bn"), LeNetBN) and isinstance(build_model("resnet"), ResNet)
    assert isinstance(build_bench_model("mlp"), WideMLP) and type(build_model("mlp")) is WideMLP
    with pytest.raises(ValueError, match="lenet-bn"):
        build_model("vgg")
    with pytest.raises(ValueError, match="book"):
        build_model("resnet", init="xavier")


def test_batchnorm_placement_and_resnet_resolution():
    lenet_bn = LeNetBN()
    bns = [m for m in lenet_bn.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert [(type(m), m.num_features) for m in bns] == [
        (nn.BatchNorm2d, 20), (nn.BatchNorm2d, 50), (nn.BatchNorm1d, 128)]
    assert has_batchnorm(lenet_bn) and has_batchnorm(ResNet()) and not has_batchnorm(LeNet())
    # BN before the activation: with BN's identity start, conv -> BN -> ReLU is nonnegative and
    # each conv channel is normalized over the batch (mean 0 before the ReLU).
    x = torch.rand(16, 1, 28, 28)
    pre = lenet_bn.bn1(lenet_bn.conv1(x))
    torch.testing.assert_close(pre.mean(dim=(0, 2, 3)), torch.zeros(20), atol=1e-5, rtol=0)
    resnet = ResNet()
    shapes = []
    hook = lambda _m, _i, out: shapes.append(tuple(out.shape[1:]))  # noqa: E731
    for block in resnet.stages:
        block.register_forward_hook(hook)
    resnet(torch.rand(2, 1, 28, 28))
    assert shapes == [(16, 28, 28), (32, 14, 14), (64, 7, 7), (128, 4, 4)]


def test_book_init_leaves_batchnorm_at_identity_and_lenet_unchanged():
    torch.manual_seed(0)
    model = build_model("lenet-bn", init="book")
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            assert torch.equal(module.weight, torch.ones_like(module.weight))
            assert torch.equal(module.bias, torch.zeros_like(module.bias))
    assert model.conv1.weight.std() < 0.02 and torch.equal(model.fc1.bias, torch.zeros(128))
    # LeNet gets exactly what the per-parameter rule gave before normalization layers existed.
    torch.manual_seed(1)
    new = book_init(LeNet())
    torch.manual_seed(1)
    old = LeNet()
    for name, param in old.named_parameters():
        nn.init.zeros_(param) if name.endswith("bias") else nn.init.normal_(param, mean=0.0, std=0.01)
    for (_, a), (_, b) in zip(new.named_parameters(), old.named_parameters()):
        assert torch.equal(a, b)


def test_convert_keeps_parameters_buffers_and_state_dict():
    torch.manual_seed(0)
    model = build_model("resnet").double()
    model.stem[1].running_mean.fill_(0.5)
    params = [id(p) for p in model.parameters()]
    state = copy.deepcopy(model.state_dict())
    synced = convert_sync_batchnorm(model, WORLD_1)
    assert [id(p) for p in synced.parameters()] == params  # optimizers and buckets stay valid
    assert sum(isinstance(m, SyncBatchNorm) for m in synced.modules()) == 9
    assert not any(type(m) in (nn.BatchNorm1d, nn.BatchNorm2d) for m in synced.modules())
    assert has_sync_batchnorm(synced) and not has_sync_batchnorm(build_model("resnet"))
    assert synced.state_dict().keys() == state.keys()
    for key, value in synced.state_dict().items():
        assert torch.equal(value, state[key]) and value.dtype == state[key].dtype, key
    plain = build_model("resnet").double()
    plain.load_state_dict(synced.state_dict())  # a sync-trained checkpoint loads into the plain model
    bare = convert_sync_batchnorm(nn.BatchNorm1d(3, affine=False).eval(), WORLD_1)
    assert isinstance(bare, SyncBatchNorm) and not bare.training and bare.weight is None
    with pytest.raises(ValueError, match="2 or 3-D"):
        convert_sync_batchnorm(nn.BatchNorm1d(3), WORLD_1)(torch.rand(2, 3, 4, 5))
    with pytest.raises(ValueError, match="forward pass"):
        convert_sync_batchnorm(nn.LazyBatchNorm2d(), WORLD_1)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", [(8, 5, 6, 7), (9, 4), (9, 4, 3)])
def test_one_process_sync_batchnorm_equals_batchnorm(shape, dtype, device):
    torch.manual_seed(0)
    ref = (nn.BatchNorm2d if len(shape) == 4 else nn.BatchNorm1d)(shape[1], momentum=None).to(device, dtype)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.normal_()
    sync = convert_sync_batchnorm(copy.deepcopy(ref), WORLD_1)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    for step in range(3):  # momentum=None: the cumulative average over num_batches_tracked
        x = (torch.randn(shape, dtype=dtype, device=device) * 3 + 5).requires_grad_()
        x2 = x.detach().clone().requires_grad_()
        g = torch.randn(shape, dtype=dtype, device=device)
        y_ref = ref(x)
        (y_ref * g).sum().backward()
        y = sync(x2)
        (y * g).sum().backward()
        torch.testing.assert_close(y, y_ref, **tol)
        torch.testing.assert_close(x2.grad, x.grad, **tol)
    torch.testing.assert_close(sync.weight.grad, ref.weight.grad, **tol)
    torch.testing.assert_close(sync.bias.grad, ref.bias.grad, **tol)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(sync, name), getattr(ref, name), **tol)
    sync.eval(), ref.eval()
    x = torch.randn(shape, dtype=dtype, device=device)
    torch.testing.assert_close(sync(x), ref(x), **tol)
    with pytest.raises(ValueError, match="more than 1 value"):
        convert_sync_batchnorm(nn.BatchNorm1d(4), WORLD_1)(torch.randn(1, 4))


@pytest.mark.parametrize("device, half", [("cpu", torch.bfloat16), pytest.param("cuda", torch.bfloat16, marks=CUDA),
                                          pytest.param("cuda", torch.float16, marks=CUDA)])
@pytest.mark.parametrize("shape", [(8, 5, 6, 7), (9, 4)])
def test_under_autocast_sync_batchnorm_does_what_batchnorm_does(shape, device, half):
    """A half/bf16 input (an autocast conv's output) beside float32 parameters: the output in the
    input's dtype, the statistics and parameter gradients in float32, as torch's BatchNorm."""
    torch.manual_seed(0)
    ref = (nn.BatchNorm2d if len(shape) == 4 else nn.BatchNorm1d)(shape[1]).to(device)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.normal_()
    sync = convert_sync_batchnorm(copy.deepcopy(ref), WORLD_1)
    x = (torch.randn(shape, device=device) * 3 + 5).to(half)
    g = torch.randn(shape, device=device).to(half)
    x_ref, x_sync = (x.clone().requires_grad_() for _ in range(2))
    with torch.autocast(device, dtype=half):
        y_ref, y = ref(x_ref), sync(x_sync)
        (y_ref.float() * g).sum().backward()
        (y.float() * g).sum().backward()
    assert y.dtype == y_ref.dtype == half and sync.weight.grad.dtype == torch.float32
    torch.testing.assert_close(y, y_ref)  # half/bf16 tolerance: a last-bit rounding may differ
    # Near-zero entries are differences of rounded terms: an absolute bound, a bf16 ulp of dy's scale.
    torch.testing.assert_close(x_sync.grad, x_ref.grad, rtol=1.6e-2, atol=1e-3)
    for name in ("weight", "bias"):
        torch.testing.assert_close(getattr(sync, name).grad, getattr(ref, name).grad, rtol=1e-2, atol=1e-2)
    for name in ("running_mean", "running_var"):  # float32 statistics of the half/bf16 values, as torch's
        torch.testing.assert_close(getattr(sync, name), getattr(ref, name), rtol=1e-5, atol=1e-5)


# The inputs for which CUDA's batch_norm_backward skips its fused kernel (a 2-D or length-1 input
# counts as channels-last there, and the fused kernel needs an input gradient); that other path
# asserts `save_mean->defined()`, so SyncBatchNorm must pass empty tensors there, not None.
UNFUSED_ON_CUDA = {"2-D": ((9, 4), torch.contiguous_format, True),
                   "length 1": ((9, 4, 1), torch.contiguous_format, True),
                   "channels_last": ((8, 5, 6, 7), torch.channels_last, True),
                   "no input grad": ((8, 5, 6, 7), torch.contiguous_format, False)}


class _BackwardSpy(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the save_mean / save_invstd arguments of every native_batch_norm_backward call."""

    def __init__(self):
        super().__init__()
        self.saved_args = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.native_batch_norm_backward.default:
            self.saved_args.append(args[5:7])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("case", sorted(UNFUSED_ON_CUDA))
def test_sync_batchnorm_backward_passes_defined_saved_statistics(case, device):
    shape, memory_format, input_grad = UNFUSED_ON_CUDA[case]
    torch.manual_seed(0)
    ref = (nn.BatchNorm2d if len(shape) == 4 else nn.BatchNorm1d)(shape[1]).to(device, torch.float64)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.normal_()
    sync = convert_sync_batchnorm(copy.deepcopy(ref), WORLD_1)
    x = (torch.randn(shape, dtype=torch.float64, device=device) * 3 + 5).contiguous(memory_format=memory_format)
    g = torch.randn(shape, dtype=torch.float64, device=device)
    x_ref, x_sync = (x.detach().clone().requires_grad_(input_grad) for _ in range(2))
    (ref(x_ref) * g).sum().backward()
    spy = _BackwardSpy()
    with spy:
        (sync(x_sync) * g).sum().backward()
    # CUDA's contract, checked on any device: both tensors defined (empty = use the given statistics).
    assert len(spy.saved_args) == 1 and all(isinstance(t, torch.Tensor) for t in spy.saved_args[0])
    tol = dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sync.weight.grad, ref.weight.grad, **tol)
    torch.testing.assert_close(sync.bias.grad, ref.bias.grad, **tol)
    if input_grad:
        torch.testing.assert_close(x_sync.grad, x_ref.grad, **tol)
    else:
        assert x_sync.grad is None


def test_statistics_are_stable_when_the_mean_dwarfs_the_spread():
    """E[x^2] - E[x]^2 in float32 would lose everything at mean 1e4, std 1 (1e8 * 6e-8 = 6 > 1)."""
    x = torch.randn(64, 3, 5, 5, generator=torch.Generator().manual_seed(0)) + 1e4
    mean, var, count = global_batch_stats(x, _Reducer(WORLD_1, None))
    exact_var, exact_mean = torch.var_mean(x.double(), dim=(0, 2, 3), correction=0)
    assert count == 64 * 25
    torch.testing.assert_close(mean, exact_mean, rtol=1e-7, atol=0)
    torch.testing.assert_close(var, exact_var, rtol=1e-3, atol=0)
    naive = (x * x).mean(dim=(0, 2, 3)) - x.mean(dim=(0, 2, 3)) ** 2
    assert ((naive.double() - exact_var).abs() / exact_var).max() > 0.1  # the trap is real


def test_gradcheck_including_the_statistics():
    """Numerical vs analytic Jacobian; the statistics are recomputed from the perturbed input,
    so the check covers the gradient through mean and variance, not just the affine map."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, 4, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, generator=gen, dtype=torch.float64, requires_grad=True)

    def fn(x, w, b):
        reduce = _Reducer(WORLD_1, None)
        mean, var, count = global_batch_stats(x.detach(), reduce)
        return SyncBatchNormFunction.apply(x, w, b, mean, var, count, 1e-5, reduce)

    assert torch.autograd.gradcheck(fn, (x, w, b))
    model = convert_sync_batchnorm(build_model("lenet-bn").double(), WORLD_1)
    images = torch.rand(4, 1, 28, 28, dtype=torch.float64)
    F.cross_entropy(model(images), torch.tensor([0, 1, 2, 3])).backward()
    assert all(p.grad is not None for p in model.parameters())


class _TwinComm:
    """A replica's comm for a world of two identical ranks: every sum doubles, and each call is noted."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int]] = []

    def allreduce_async(self, packed, *, algorithm, tag):
        self.calls.append((tag.phase, algorithm, packed.numel()))
        packed.mul_(2)
        return types.SimpleNamespace(wait=lambda: None)  # done already


def test_routed_layers_sum_through_the_replica_s_exchange_and_copies_do_not(monkeypatch):
    """DataParallel routes its SyncBatchNorm layers to its own exchange (route_sync_batchnorm): both
    sums of a step go through it, tagged, in order; a deepcopy of the model (an EMA's) and a layer
    given back with None sum with the backend's allreduce again."""
    from phalanx.data_parallel import sync_batchnorm
    world2 = World(rank=0, world_size=2, local_rank=0, local_world_size=2, device=torch.device("cpu"),
                   backend="gloo", timeout_s=10.0)
    backend: list[int] = []
    monkeypatch.setattr(sync_batchnorm, "allreduce_native",
                        lambda packed, **_: (backend.append(packed.numel()), packed.mul_(2)))
    torch.manual_seed(0)
    model = convert_sync_batchnorm(nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3)), world2)
    comm = _TwinComm()
    assert sync_batchnorm.route_sync_batchnorm(model, comm, "shm") == 1
    x = torch.randn(4, 1, 6, 6, dtype=torch.float64)
    model.double()(x).square().sum().backward()
    assert comm.calls == [("SyncBatchNorm forward", "shm", 8), ("SyncBatchNorm backward", "shm", 7)] and not backend
    reference = copy.deepcopy(model)  # two identical ranks: the statistics of the doubled batch are this batch's
    reference(x).sum().backward()
    assert backend == [8, 7] and len(comm.calls) == 2  # the copy is not routed
    sync_batchnorm.route_sync_batchnorm(model, None)
    model(x)
    assert backend == [8, 7, 8] and len(comm.calls) == 2
