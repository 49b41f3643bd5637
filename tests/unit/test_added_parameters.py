"""A parameter added to the model after its buckets were laid out is named (layout.py's
`check_added`): appended, or put in place of a layer; a model made elsewhere (an EMA copy), a
parameter removed (weights tied) and a replica compiled after prepare are not. One process: the
layout alone (tests/distributed/test_added_parameters.py: 2 workers, and prepare again)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from phalanx.data_parallel.layout import BucketLayout
from phalanx.errors import UsageError


def _layout(module: nn.Module) -> BucketLayout:
    return BucketLayout(module, bucket_cap_mb=25.0, first_bucket_cap_mb=None, shard="none")


def test_a_parameter_added_after_the_layout_is_named():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8))
    layout = _layout(model)
    layout.check_added()
    copy.deepcopy(model)  # registrations elsewhere: looked at, nothing new here
    nn.Linear(3, 3)
    layout.check_added()
    model[2].weight = model[2].weight  # registered again, the same parameter
    layout.check_added()
    model.append(nn.Linear(8, 3))
    with pytest.raises(UsageError, match=r"^parameter 3.weight was added to the model after prepare \(a layer "
                                         r"appended or replaced, load_state_dict\(assign=True\)\): no gradient "
                                         r"bucket holds it, so each rank would train its own copy; prepare again"):
        layout.check_added()


def test_a_replaced_layer_is_named_and_a_removed_parameter_is_not():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8, bias=False))
    layout = _layout(model)
    del model[2].weight  # a parameter gone: its slot keeps no gradient, nothing to refuse
    layout.check_added()
    model[2].weight = nn.Parameter(torch.zeros(8, 8))  # and another in its place
    with pytest.raises(UsageError, match=r"^parameter 2.weight was added"):
        layout.check_added()


def test_compiling_the_replica_registers_nothing_in_it():
    model = nn.Sequential(nn.Linear(4, 8))
    layout = _layout(model)
    wrapper = nn.Module()
    wrapper.inner = model  # what torch.compile's OptimizedModule does with the module it wraps
    layout.check_added()


def test_parameters_loaded_with_assign_are_named():
    model = nn.Sequential(nn.Linear(4, 8))
    layout = _layout(model)
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})  # copied in place: the same
    layout.check_added()
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    with pytest.raises(UsageError, match=r"^parameter 0.weight was added"):
        layout.check_added()


def test_a_world_of_one_refuses_an_added_parameter_as_k_ranks_do():
    """One device has no buckets: its zero_grad cleared the parameters listed at prepare, so a
    weight_norm added after prepare kept its first gradients, summed into every later step's (0.34
    relative off torch alone after 4 SGD steps, silently, where 2 ranks refused it)."""
    import phalanx
    from phalanx.runtime.world import World

    world = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
                  backend="none", timeout_s=10.0)
    for call in ("zero_grad", "finish_gradient_sync"):
        dp = phalanx.prepare(nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)), world=world)
        dp.zero_grad()
        dp.finish_gradient_sync()
        torch.nn.utils.parametrizations.weight_norm(dp.module[0])
        with pytest.raises(UsageError, match=r"^parameter 0.parametrizations.weight.original0 was added to the "
                                             r"model after prepare .* prepare again"):
            getattr(dp, call)()
