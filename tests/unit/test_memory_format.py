"""Channels-last replicas: gradient buckets follow the weights' layout, and the format changes
speed, never the update (checked against the default layout in a world of size 1)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from phalanx.models import LeNet
from phalanx.data_parallel import DataParallel, DataParallelConfig, apply_memory_format, resolve_memory_format
from phalanx.data_parallel.buckets import build_buckets, grad_view, grads_are_bucket_views
from phalanx.train import train_batch
from phalanx.runtime.world import World

WORLD1 = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
               backend="none", timeout_s=10.0)
CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def test_auto_picks_channels_last_for_cpu_conv_nets_only():
    assert resolve_memory_format("auto", LeNet(), CPU) is torch.channels_last
    assert resolve_memory_format("auto", LeNet(), CUDA) is torch.contiguous_format
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
    assert resolve_memory_format("auto", mlp, CPU) is torch.contiguous_format
    assert resolve_memory_format("channels_last", mlp, CUDA) is torch.channels_last
    assert resolve_memory_format("contiguous", LeNet(), CPU) is torch.contiguous_format
    with pytest.raises(ValueError, match="auto, channels_last, contiguous"):
        resolve_memory_format("nhwc", LeNet(), CPU)


def test_grad_view_has_the_parameters_strides_and_aliases_the_buffer():
    weight = torch.empty(50, 20, 5, 5).to(memory_format=torch.channels_last)
    buffer = torch.zeros(7 + weight.numel())
    view = grad_view(buffer, 7, weight)
    assert view.shape == weight.shape and view.stride() == weight.stride()
    assert view.data_ptr() == buffer[7:].data_ptr()
    view.fill_(1.0)  # writes exactly the param's slice of the buffer, nothing outside it
    assert buffer[:7].sum() == 0 and buffer[7:].sum() == weight.numel()
    plain = torch.empty(3, 4)
    assert grad_view(buffer, 0, plain).stride() == plain.stride()


def test_backward_accumulates_into_channels_last_bucket_views():
    torch.manual_seed(0)
    model = apply_memory_format(LeNet().double(), torch.channels_last)
    reference = LeNet().double()
    reference.load_state_dict(model.state_dict())
    buckets = build_buckets(list(model.parameters()), cap_bytes=None)
    X, y = torch.randn(6, 1, 28, 28, dtype=torch.float64), torch.arange(6) % 10
    for net in (model, reference):
        F.cross_entropy(net(X), y).backward()
    assert grads_are_bucket_views(buckets)  # autograd kept our views, no re-layout
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        # Same layout: equal strides on every dimension longer than one (a size-1 dim's stride
        # is arbitrary; conv1's weight with one input channel is both NCHW and NHWC).
        assert [st for st, n in zip(p.grad.stride(), p.shape) if n > 1] == \
            [st for st, n in zip(p.stride(), p.shape) if n > 1], name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_channels_last_training_equals_the_default_layout():
    torch.manual_seed(1)
    base = LeNet().double()
    results = []
    for memory_format in (torch.contiguous_format, torch.channels_last):
        model = apply_memory_format(copy.deepcopy(base), memory_format)
        with DataParallel(model, world=WORLD1, options=DataParallelConfig(overlap=False)) as dp:
            optimizer = torch.optim.SGD(dp.module.parameters(), lr=0.1)
            for step in range(3):
                gen = torch.Generator().manual_seed(step)
                X = torch.randn(16, 1, 28, 28, generator=gen, dtype=torch.float64)
                y = torch.randint(0, 10, (16,), generator=gen)
                train_batch(dp, optimizer, X, y, global_batch_size=16)
        results.append({k: v.contiguous() for k, v in model.state_dict().items()})
    for key in results[0]:
        torch.testing.assert_close(results[1][key], results[0][key], rtol=1e-9, atol=1e-11, msg=key)


def test_grad_view_keeps_the_stride_of_a_size_one_dimension():
    """conv1's weight with one input channel in channels_last, (6, 1, 5, 5) with strides (25, 1, 5, 1),
    is contiguous too, but the stride of its one channel decides the format a convolution takes:
    a view with contiguous strides (25, 25, 5, 1) made conv1's output contiguous, and every layer
    after it converted activations back (a sharded replica's parameters become these views)."""
    weight = torch.empty(6, 1, 5, 5).to(memory_format=torch.channels_last)
    assert weight.stride() == (25, 1, 5, 1) and weight.is_contiguous()
    view = grad_view(torch.zeros(weight.numel()), 0, weight)
    assert view.stride() == weight.stride()
    out = F.conv2d(torch.randn(2, 1, 28, 28), view)
    assert out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous()

