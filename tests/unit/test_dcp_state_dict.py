"""torch.distributed.checkpoint (DCP) on a replica: `get_state_dict(dp, optimizer)` names model and
optimizer state as the plain model's are named, a resume through `dcp.save`/`dcp.load` continues
bitwise, and a sharded replica is one line naming phalanx.checkpoint.

Before 2026-12-05 `get_state_dict(dp, optimizer)` stopped in torch's code ("'DataParallel' object has no
attribute '0'"): DCP walks the names `dp.named_parameters()` gives (the model's, unprefixed) from the
replica itself. Worse, the gradient buckets' views made `.grad` a zero tensor before the first backward,
where one device (and DDP) has None, so DCP took the optimizer as already stepped, left its state out
of the template, and `dcp.load` restored the parameters but not Adam's moments: the resumed run went
on silently as from a fresh optimizer.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint import state_dict as dcp_state_dict  # noqa: E402

from phalanx.data_parallel import DataParallelConfig, prepare_replica  # noqa: E402
from phalanx.data_parallel.buckets import grads_are_bucket_views  # noqa: E402
from phalanx.data_parallel.step import shard_loss  # noqa: E402
from phalanx.errors import UsageError  # noqa: E402
from phalanx.runtime.world import World  # noqa: E402

WORLD1 = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
               backend="none", timeout_s=10.0)
BATCH = 12
# torch 2.7 and later ask a module whose state_dict keys skip an attribute for the names it skips
# (`_fqn_modifiers`); before, set_state_dict names the optimizer state by the walk through `module` and
# stops in torch with KeyError: 'module.0.weight', and a sharded replica's refusal is torch's KeyError: 0.
ASKS_THE_REPLICA = "dsd_fqn_modifiers" in inspect.signature(dcp_state_dict._get_fqns).parameters
BEFORE_2_7 = "torch before 2.7 does not ask the replica its names (_fqn_modifiers): a KeyError inside torch"
# dcp.save/load outside a process group say they write/read as one process: what these tests mean.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).double()


def _replica(shard: str = "none"):
    """A replica on one device that builds its buckets and exchanges as k devices' does (exchange_alone)."""
    return prepare_replica(_net(), DataParallelConfig(shard=shard, exchange_alone=True), world=WORLD1,
                           dtype="float64")


def _optimizer(dp, how: str) -> torch.optim.Optimizer:
    if how == "dp.optimizer":
        return dp.optimizer(torch.optim.AdamW, lr=0.05)
    return torch.optim.AdamW(dp.parameters(), lr=0.05)


def _steps(dp, optimizer, steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(BATCH, 6, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 3, (BATCH,), generator=generator)
        optimizer.zero_grad()
        shard_loss(F.cross_entropy(dp(x), y, reduction="sum"), BATCH).backward()
        if hasattr(dp, "finish_gradient_sync"):  # (the plain model: one device)
            dp.finish_gradient_sync()
        optimizer.step()


def test_a_replicas_gradients_are_none_until_its_first_backward_as_on_one_device():
    dp = _replica()
    assert dp.buckets and all(param.grad is None for param in dp.parameters())
    optimizer = dp.optimizer(torch.optim.SGD, lr=0.1)
    _steps(dp, optimizer, range(1))
    assert grads_are_bucket_views(dp.buckets)  # bound at their first landing: backward writes into them from here
    dp.close()
    dp = _replica()
    dp.zero_grad()  # None stays None, as torch's zero_grad leaves it (before 2026-12-05: zeroed slots)
    assert all(param.grad is None for param in dp.parameters())
    dp.zero_grad(set_to_none=False)  # zeroed slots a script may write its gradients into (p.grad.copy_(g))
    assert grads_are_bucket_views(dp.buckets) and not any(param.grad.any() for param in dp.parameters())
    dp.close()


def test_the_models_names_resolve_on_the_replica_as_dp_named_parameters_gives_them():
    dp = _replica()
    model = dp.module
    assert dp.get_submodule("2") is model[2] and dp.get_parameter("0.weight") is model[0].weight
    assert [name for name, _ in dp.named_parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    x = torch.randn(4, 6, dtype=torch.float64)  # torch.func swaps a parameter by the same name
    zeros = {"2.weight": torch.zeros_like(model[2].weight)}
    assert torch.equal(torch.func.functional_call(dp, zeros, (x,)), model[2].bias.detach().expand(4, 3))
    dp.close()


@pytest.mark.parametrize("how", ["dp.optimizer", "torch.optim"])
def test_get_state_dict_names_the_state_as_the_plain_models(how):
    dp = _replica()
    optimizer = _optimizer(dp, how)
    _steps(dp, optimizer, range(2))
    model_state, optimizer_state = dcp_state_dict.get_state_dict(dp, optimizer)
    plain = _net()
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=0.05)
    _steps(plain, plain_optimizer, range(2))
    plain_model_state, plain_optimizer_state = dcp_state_dict.get_state_dict(plain, plain_optimizer)
    assert list(model_state) == list(plain_model_state) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert list(optimizer_state["state"]) == list(plain_optimizer_state["state"])
    for name, value in plain_model_state.items():  # one device's update, to the bit
        assert torch.equal(model_state[name], value), name
    dp.close()


@pytest.mark.skipif(not ASKS_THE_REPLICA, reason=BEFORE_2_7)
@pytest.mark.parametrize("zero_grad_first", [False, True])
@pytest.mark.parametrize("how", ["dp.optimizer", "torch.optim"])
def test_a_resume_through_dcp_save_and_load_continues_bitwise(tmp_path, how, zero_grad_first):
    straight = _replica()
    straight_optimizer = _optimizer(straight, how)
    _steps(straight, straight_optimizer, range(6))

    first = _replica()
    first_optimizer = _optimizer(first, how)
    _steps(first, first_optimizer, range(3))
    model_state, optimizer_state = dcp_state_dict.get_state_dict(first, first_optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp_path / "dcp")

    resumed = _replica()  # a fresh process's replica: no step taken yet
    resumed_optimizer = _optimizer(resumed, how)
    if zero_grad_first:  # a loop's zero_grad before the load: before 2026-12-05 it made zeroed slots, which
        resumed_optimizer.zero_grad()  # DCP's template read as "stepped": the moments were left out, silently
    model_state, optimizer_state = dcp_state_dict.get_state_dict(resumed, resumed_optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=tmp_path / "dcp")
    dcp_state_dict.set_state_dict(resumed, resumed_optimizer, model_state_dict=state["model"],
                                  optim_state_dict=state["optimizer"])
    assert [s["step"] for s in resumed_optimizer.state.values()] == [3.0] * 4  # Adam's moments came back
    _steps(resumed, resumed_optimizer, range(3, 6))
    for (name, value), ours in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(ours, value), name
    for dp in (straight, first, resumed):
        dp.close()


@pytest.mark.skipif(not ASKS_THE_REPLICA, reason=BEFORE_2_7)
@pytest.mark.parametrize("stage", ["optimizer", "parameters"])
def test_dcp_on_a_sharded_replica_is_one_line_naming_phalanx_checkpoint(stage):
    dp = _replica(stage)
    optimizer = dp.optimizer(torch.optim.AdamW, lr=0.05)
    _steps(dp, optimizer, range(1))
    with pytest.raises(UsageError, match=rf"^torch.distributed.checkpoint's state-dict functions .* shard=\"{stage}\" "
                                         r"does not hold .*: save with phalanx.checkpoint\(...\) and resume with "
                                         r"phalanx.resume\(...\)"):
        dcp_state_dict.get_state_dict(dp, optimizer)
    dp.close()
