"""BatchNorm across devices: synchronized statistics (any device, gloo or NCCL) or per-device ones.

With data parallelism each device sees only its shard of the global batch, so a plain BatchNorm
layer normalizes with its shard's mean and variance (the chapter's per-device statistics, policy
`local`): cheaper, but k-device training then differs from 1-device training, and the replicas'
running statistics drift apart. `SyncBatchNorm` (policy `sync`) makes every rank normalize with
the statistics of the *whole* global batch, so forward, gradients and running statistics equal
1-device BatchNorm on the full batch. torch's own SyncBatchNorm refuses CPU tensors and
Horovod's is CUDA-only; this one is an `autograd.Function` over `phalanx.comm`'s allreduce:

- forward: one allreduce of a packed float64 tensor [ranks, count, sum(C), sum of squares(C)].
  Each rank's sums come from its shard's centered mean and variance (torch's fused statistics
  kernel), combined in float64, so the cancellation in E[x^2] - E[x]^2 costs ~1e-16 relative.
  A rank with an empty shard contributes zeros and still joins the collective.
- backward: one allreduce of [ranks, sum(dy)(C), sum(dy * xhat)(C)], the two per-channel sums
  the exact input gradient needs (Ioffe & Szegedy 2015, section 3):
  dx = w / sigma * (dy - mean(dy) - xhat * mean(dy * xhat)), means over the global batch.
  The weight and bias gradients stay *local* sums: DataParallel sums them across ranks.
- running statistics use the global mean and the global unbiased variance (as torch), from the
  same allreduced numbers on every rank, so they stay identical on all replicas.
- eval mode uses the running statistics and communicates nothing.
- under autocast (CPU bf16; CUDA fp16, bf16) it does what torch's BatchNorm does there: a
  half/bf16 input (a conv's output) beside float32 parameters is normalized with float32
  statistics (summed in float32, combined in float64) and comes out in the input's dtype.
- a replica routes its layers' two sums to its own exchange (`route_sync_batchnorm`), queued in
  launch order behind the buckets in flight: between CPU workers the shared-memory allreduce
  instead of gloo's loopback one (LeNet-BN, 2 workers: 0.66 -> 0.51 s an epoch, measured
  2026-12-02 on 2 cores). Outside a replica, and on GPUs (native), the backend's allreduce.

Ordering contract (the one every collective has): every rank runs forward and backward through
the same BatchNorm layers in the same order - also a rank whose shard is empty (it runs them on
0 examples). The collectives are synchronous and, by default, on the world's default group,
where DataParallel's overlapped `native` bucket allreduces are also issued (asynchronously, from
the backward hooks on the same thread); with identical graphs both sequences are identical on
every rank, so they pair up. The hand-written algorithms' buckets run on AsyncComm's private
group and cannot interleave at all on gloo (on NCCL two communicators then run concurrently, which
NCCL only promises to handle when every rank issues them in the same order: with SyncBatchNorm on
GPUs prefer `native`). A "ranks" slot in every packed tensor must sum to the world size, which
catches a collective paired with a foreign one instead of returning wrong numbers.

Policy `local` keeps plain BatchNorm layers. Parameters stay identical (gradients are summed),
but each replica's running statistics follow its own shards; `DataParallel` averages them across
ranks after every synced step (guards/running_stats.py: one small allreduce), so the replicas are one
model at every point - before evaluation and saving included.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.function import once_differentiable

from phalanx.comm import Tag, allreduce_native
from phalanx.runtime.world import World

BATCHNORM_POLICIES = ("sync", "local")
_INPUT_DIMS = {nn.BatchNorm1d: (2, 3), nn.BatchNorm2d: (4,), nn.BatchNorm3d: (5,)}


# The exchange of the replica holding a layer (route_sync_batchnorm), by layer; weakly keyed, so a
# copy of the model (an EMA's deepcopy) or a layer outside any replica sums with the backend's.
_EXCHANGES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def route_sync_batchnorm(module: nn.Module, comm=None, algorithm: str | None = None) -> int:
    """Sum the statistics of `module`'s SyncBatchNorm layers on the world's default group through
    `comm` (a replica's AsyncComm) with `algorithm`, queued in its launch order behind any bucket
    in flight: shared memory between CPU workers, ~15 us a call where gloo's loopback allreduce
    took ~2 ms, every layer twice a step. `comm=None` gives them back to the backend's allreduce.
    Returns how many layers it routed."""
    layers = [m for m in module.modules() if isinstance(m, SyncBatchNorm) and m.group is None]
    for layer in layers:
        if comm is None:
            _EXCHANGES.pop(layer, None)
        else:
            _EXCHANGES[layer] = functools.partial(_sum_through, comm, algorithm)
    return len(layers)


def _sum_through(comm, algorithm: str, packed: torch.Tensor, what: str) -> None:
    comm.allreduce_async(packed, algorithm=algorithm, tag=Tag(f"SyncBatchNorm {what}")).wait()


class _Reducer:
    """Sums a packed float64 tensor over the ranks of `group` (default: the whole world), through
    `exchange` where a replica routed the layer to its own."""

    def __init__(self, world: World, group: dist.ProcessGroup | None, exchange=None) -> None:
        self.world, self.group, self.exchange = world, group, exchange

    def __call__(self, packed: torch.Tensor, what: str) -> torch.Tensor:
        packed[0] = 1.0  # the "ranks" slot
        if self.world.distributed:
            if self.exchange is not None:
                self.exchange(packed, what)
            else:
                allreduce_native(packed, world=self.world, group=self.group)
            expected = self.world.world_size if self.group is None else dist.get_world_size(self.group)
            if packed[0].item() != expected:
                raise RuntimeError(
                    f"SyncBatchNorm {what} allreduce was paired with a different collective (ranks slot "
                    f"{packed[0].item()} != {expected}); every rank must run forward and backward through "
                    "the same BatchNorm layers in the same order, also with an empty shard"
                )
        return packed


_REDUCED = (torch.float16, torch.bfloat16)


def _stats_dtype(x: torch.Tensor, weight: torch.Tensor | None) -> torch.dtype:
    """The dtype torch's BatchNorm kernels take statistics in beside `x` and `weight`: x's own,
    except a half/bf16 input (an autocast conv's or linear's output) with float32 or no parameters,
    torch's mixed-precision BatchNorm: statistics and parameters float32, output in x's dtype. The
    CPU and CUDA kernels refuse that input with a half/bf16 statistic beside a float32 weight."""
    if x.dtype in _REDUCED and (weight is None or weight.dtype == torch.float32):
        return torch.float32
    return x.dtype


def _normalize(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, weight, bias, eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias per channel: torch's fused inference kernel."""
    dtype = _stats_dtype(x, weight)
    return nn.functional.batch_norm(x, mean.to(dtype), var.to(dtype), weight, bias, False, 0.0, eps)


@torch.no_grad()
def global_batch_stats(x: torch.Tensor, reduce: _Reducer) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(mean, biased variance) per channel over the global batch, in float64, and its count."""
    channels = x.shape[1]
    count = x.numel() // channels if channels else 0
    packed = torch.zeros(2 + 2 * channels, dtype=torch.float64, device=x.device)
    if count > 0:
        # torch's fused statistics kernel (centered, so stable; 4-5x faster than var_mean on CPU).
        # A half/bf16 input is summed in float32 as torch's own BatchNorm does; the kernel returns
        # float32 statistics only beside float32 running ones (momentum 0 leaves these unchanged).
        running = (torch.zeros(channels, device=x.device), torch.ones(channels, device=x.device)) \
            if x.dtype in _REDUCED else (None, None)
        mean, var = torch.batch_norm_update_stats(x, *running, 0.0)
        mean64, var64 = mean.double(), var.double()
        packed[1] = count
        packed[2 : 2 + channels] = count * mean64
        packed[2 + channels :] = count * (var64 + mean64 * mean64)
    reduce(packed, "forward")
    total = int(packed[1].item())
    if total <= 1:
        # Every rank sees the same total, so every rank raises here: nobody is left waiting.
        raise ValueError(f"SyncBatchNorm needs more than 1 value per channel over the global batch, got {total}")
    mean = packed[2 : 2 + channels] / total
    var = (packed[2 + channels :] / total - mean * mean).clamp_(min=0.0)
    return mean, var, total


class SyncBatchNormFunction(torch.autograd.Function):
    """y = (x - mean) / sqrt(var + eps) * w + b with global (mean, var) given; exact global backward.

    Both directions run torch's fused BatchNorm kernels (CPU and CUDA) with the global statistics
    passed as if they were running statistics: the inference kernel normalizes; the
    inference-mode backward's reduction gives this rank's sum(dy) and sum(dy * xhat); the input
    gradient from the global sums is one more inference-kernel pass and an in-place addcmul.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, mean, var, count, eps, reduce):
        ctx.save_for_backward(x, weight, mean, var)
        ctx.count, ctx.eps, ctx.reduce = count, eps, reduce
        ctx.has_bias = bias is not None
        return _normalize(x, mean, var, weight, bias, eps)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, mean, var = ctx.saved_tensors
        channels = x.shape[1]
        dtype = _stats_dtype(x, weight)
        w = weight if weight is not None else torch.ones(channels, dtype=dtype, device=x.device)
        if x.numel() > 0:
            # This rank's sum(dy * xhat) and sum(dy) alone: the kernel's reduction pass, without the
            # input gradient it would make from this shard's statistics.
            # save_mean / save_invstd must be *defined* tensors; empty ones mean "not saved: use the
            # running statistics" (our global ones). None works on the CPU, and on CUDA only where
            # the fused kernel runs: CUDA's other path (a 2-D BatchNorm1d input, channels_last, or
            # no input gradient) asserts `save_mean->defined()` (aten/src/ATen/native/
            # cuda/Normalization.cu, batch_norm_backward_cuda).
            not_saved = x.new_empty(0, dtype=dtype)
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                dy, x, w, mean.to(dtype), var.to(dtype), not_saved, not_saved, False, ctx.eps,
                [False, True, True])
        else:  # an empty shard (the CPU kernel divides by its size): no local contribution
            sum_dy_xhat = sum_dy = torch.zeros(channels, dtype=w.dtype, device=x.device)
        grad_x = None
        if ctx.needs_input_grad[0]:
            packed = torch.empty(1 + 2 * channels, dtype=torch.float64, device=x.device)
            packed[1 : 1 + channels] = sum_dy
            packed[1 + channels :] = sum_dy_xhat
            ctx.reduce(packed, "backward")
            # dx = w / sigma * (dy - mean(dy) - xhat * mean(dy * xhat)), means over the global batch:
            # the xhat terms, an affine map of xhat per channel, in one pass of the inference kernel
            # (x - mean first, so a large mean costs no precision), then w / sigma * dy added in place.
            # Two passes over the activations where the input gradient of the shard's own statistics
            # and an add took three (backward 1.2-3x faster, measured 2026-12-02 on 2 cores).
            scale = torch.rsqrt(var + ctx.eps) * w.double()
            shift_w = -scale * packed[1 + channels :] / ctx.count
            shift_b = -scale * packed[1 : 1 + channels] / ctx.count
            per_channel = (1, channels) + (1,) * (x.dim() - 2)
            grad_x = _normalize(x, mean, var, shift_w.to(dtype), shift_b.to(dtype), ctx.eps).addcmul_(
                dy, scale.to(dtype).view(per_channel))
        # The parameter gradients stay this rank's sums: DataParallel sums them across ranks.
        grad_weight = sum_dy_xhat if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm whose training statistics span every rank of `world`; same state_dict as BatchNorm.

    `group`: a process group to synchronize over instead of the world's default group (every
    rank of the world must belong to it). The module holds `world` (and `group`), so build it,
    or `convert_sync_batchnorm`, inside the worker, before wrapping the model in DataParallel.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, *, world: World, group: dist.ProcessGroup | None = None,
                 input_dims: tuple[int, ...] | None = None, device=None, dtype=None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.world = world
        self.group = group
        self.input_dims = input_dims  # the replaced layer's accepted ranks; None: any >= 2

    def _check_input_dim(self, input: torch.Tensor) -> None:
        allowed = self.input_dims
        if input.dim() < 2 or (allowed is not None and input.dim() not in allowed):
            wanted = "at least 2" if allowed is None else " or ".join(map(str, allowed))
            raise ValueError(f"expected {wanted}-D input (got {input.dim()}-D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if x.shape[1] != self.num_features:
            raise ValueError(f"expected {self.num_features} channels, got input of shape {tuple(x.shape)}")
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        if not self.training:  # running statistics (or, without them, this shard's own): no communication
            return nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                            self.running_mean is None, factor, self.eps)
        reduce = _Reducer(self.world, self.group, _EXCHANGES.get(self))
        mean, var, count = global_batch_stats(x.detach(), reduce)
        if self.track_running_stats:
            with torch.no_grad():  # torch's rule: biased variance normalizes, unbiased is tracked
                self.running_mean.mul_(1.0 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                unbiased = (var * (count / (count - 1))).to(self.running_var.dtype)
                self.running_var.mul_(1.0 - factor).add_(unbiased, alpha=factor)
        return SyncBatchNormFunction.apply(x, self.weight, self.bias, mean, var, count, self.eps, reduce)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", synchronized over {self.world.world_size} rank(s)"


def convert_sync_batchnorm(module: nn.Module, world: World, *, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Replace every BatchNorm1d/2d/3d (and torch's SyncBatchNorm) in `module` by `SyncBatchNorm`.

    The new layers take over the old ones' parameters (the same Parameter objects), buffers,
    training flag, device and dtype. Returns the module (a new one when `module` itself is a
    BatchNorm layer). Call it on every rank before DataParallel, whose buckets hold the parameters.
    """
    converted = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, SyncBatchNorm):
        if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
            raise ValueError(f"{type(module).__name__} is not initialized yet; run one forward pass before converting")
        input_dims = next((dims for cls, dims in _INPUT_DIMS.items() if isinstance(module, cls)), None)
        reference = module.running_mean if module.running_mean is not None else module.weight
        converted = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                  module.track_running_stats, world=world, group=group, input_dims=input_dims,
                                  device=None if reference is None else reference.device,
                                  dtype=None if reference is None else reference.dtype)
        if module.affine:
            converted.weight, converted.bias = module.weight, module.bias
        if module.track_running_stats:
            converted.running_mean, converted.running_var = module.running_mean, module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
    for name, child in module.named_children():
        converted.add_module(name, convert_sync_batchnorm(child, world, group=group))
    return converted


def has_sync_batchnorm(module: nn.Module) -> bool:
    """True when `module` communicates in forward/backward, so every rank must run both each step."""
    return any(isinstance(m, SyncBatchNorm) for m in module.modules())


def has_plain_batchnorm(module: nn.Module) -> bool:
    """True when `module` has a BatchNorm layer that normalizes with its own device's shard only."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, SyncBatchNorm)
               for m in module.modules())
