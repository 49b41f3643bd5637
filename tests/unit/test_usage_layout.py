"""usage.py and layout.py in one process: the flags after the last bucket, the gradients no rank
used dropped and given back, the layout laid out again when requires_grad changes, and the
separate sum of parameters unfrozen inside a step (its allreduce faked: a peer's values added)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from phalanx.data_parallel.buckets import build_buckets
from phalanx.data_parallel.layout import BucketLayout, sum_newly_trainable
from phalanx.data_parallel.usage import ParameterUsage, usage_elements
from phalanx.errors import UsageError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def _usage(model: nn.Module, cap_bytes: int | None = None):
    params = list(model.parameters())
    buckets = build_buckets(params, cap_bytes=cap_bytes, spare=usage_elements(params))
    return buckets, ParameterUsage(buckets)


def test_spare_elements_follow_the_last_buckets_gradients_only():
    model = _model()
    buckets = build_buckets(list(model.parameters()), cap_bytes=64, spare=4)
    *others, last = buckets
    assert len(buckets) > 1 and all(b.storage is b.buffer for b in others)
    assert last.storage.numel() == last.buffer.numel() + 4 and last.storage.data_ptr() == last.buffer.data_ptr()
    assert all(p.grad.data_ptr() < last.buffer.data_ptr() + last.buffer.numel() * 8 for p in last.params)
    assert build_buckets(list(_model().parameters()))[0].storage is not None


def test_flags_say_what_this_rank_used():
    model = _model()
    buckets, usage = _usage(model, cap_bytes=64)
    params = usage.params  # in bucket order: the last layer's first
    for param in params[:2]:
        usage.landed(param)
    usage.write_flags()
    assert usage.flags.tolist() == [1.0, 1.0, 0.0, 0.0]
    for param in params[2:]:
        usage.landed(param)
    usage.write_flags()
    assert usage.flags.tolist() == [1.0] * 4


def test_what_no_rank_used_loses_its_gradient_and_gets_its_view_back_at_its_next_landing():
    model = _model()
    buckets, usage = _usage(model)
    params = usage.params
    usage.landed(params[0])
    usage.landed(params[1])
    usage.write_flags()
    usage.flags.copy_(torch.tensor([2.0, 2.0, 1.0, 0.0]))  # after the sum: a peer used params[2], nobody params[3]
    assert usage.after_sum() == [params[3]]
    assert params[3].grad is None and params[2].grad is not None
    usage.restore()  # zero_grad: None stays None, as torch's zero_grad leaves it
    assert params[3].grad is None
    params[3].grad = torch.ones_like(params[3])  # a backward reached it: autograd's fresh tensor
    usage.landed(params[3])
    slot = buckets[0].buffer[buckets[0].offsets[3]:]
    assert params[3].grad.data_ptr() == slot.data_ptr() and torch.equal(params[3].grad, torch.ones_like(params[3]))


def test_a_rank_that_used_everything_reads_no_flag():
    model = _model()
    _, usage = _usage(model)
    for param in usage.params:
        usage.landed(param)
    usage.flags.fill_(0.0)  # what it would read, were it to read: nothing it drops all the same
    assert usage.after_sum() == [] and all(p.grad is not None for p in usage.params)


def test_a_dropped_gradient_landing_again_goes_back_into_its_bucket():
    model = _model()
    buckets, usage = _usage(model)
    usage.after_sum()  # nothing landed, flags all zero: everything dropped
    assert all(p.grad is None for p in model.parameters())
    hooks = [p.register_post_accumulate_grad_hook(usage.landed) for p in model.parameters()]  # as the replica's
    model(torch.ones(2, 3, dtype=torch.float64)).sum().backward()  # autograd makes fresh tensors
    for hook in hooks:
        hook.remove()
    bucket = buckets[0]
    for param, offset in zip(bucket.params, bucket.offsets):
        assert param.grad.data_ptr() == bucket.buffer[offset:].data_ptr()
    reference = _model()
    reference(torch.ones(2, 3, dtype=torch.float64)).sum().backward()
    assert torch.equal(bucket.buffer, torch.cat([p.grad.reshape(-1) for p in reversed(list(reference.parameters()))]))


def test_a_layout_drops_frozen_gradients_and_lays_out_only_what_trains():
    model = _model()
    model[0].requires_grad_(False)
    layout = BucketLayout(model, bucket_cap_mb=None, first_bucket_cap_mb=None, shard="none")
    assert [p for b in layout.buckets for p in b.params] == [model[2].bias, model[2].weight]
    assert layout.usage.flags.numel() == 2 and not layout.changed
    model[0].requires_grad_(True)
    model[2].requires_grad_(False)
    assert layout.changed and layout.first_change() == "0.weight"
    model[2].weight.grad = torch.full_like(model[2].weight, 3.0)  # a gradient held from before
    assert layout.before_step()  # laid out again, gradients views of the new buckets
    assert model[2].weight.grad is None and model[2].bias.grad is None
    assert [p for b in layout.buckets for p in b.params] == [model[0].bias, model[0].weight]
    assert layout.usage.flags.numel() == 2 and not layout.changed


def test_gradients_are_none_until_they_land_or_zero_grad_without_set_to_none_and_a_frozen_layer_keeps_none():
    # The first layout leaves every gradient None, as one device's before a backward, and zero_grad()
    # leaves them so (DCP's template reads a gradient as "stepped"); a layer frozen at construction
    # has no slot, so zero_grad(set_to_none=False) must not look one up (a KeyError in restore(), once).
    model = _model()
    model[0].requires_grad_(False)
    layout = BucketLayout(model, bucket_cap_mb=None, first_bucket_cap_mb=None, shard="none")
    assert all(param.grad is None for param in model.parameters())
    assert not layout.before_step()
    assert all(param.grad is None for param in model.parameters())
    assert not layout.before_step(set_to_none=False)  # zeroed slots, for gradients written in by hand
    assert model[0].weight.grad is None and model[0].bias.grad is None
    assert all(param.grad is not None and not param.grad.any() for param in model[2].parameters())


def test_frozen_inside_a_step_keeps_a_copy_of_its_summed_gradient():
    model = _model()
    layout = BucketLayout(model, bucket_cap_mb=None, first_bucket_cap_mb=None, shard="none")
    for param in layout.usage.params:
        layout.usage.landed(param)
    model[2].weight.grad.fill_(5.0)
    model[2].requires_grad_(False)
    assert layout.after_sum(lambda flat: None)
    assert torch.equal(model[2].weight.grad, torch.full((2, 4), 5.0, dtype=torch.float64))
    assert all(model[2].weight.grad.data_ptr() != b.storage.data_ptr() for b in layout.buckets)


def test_sum_newly_trainable_adds_a_peers_gradients_and_drops_what_nobody_used():
    model = _model()
    a, b = model[0].weight, model[2].bias
    a.grad = torch.ones_like(a)
    b.grad = None
    peer = {"a": torch.full_like(a, 2.0), "b_used": 0.0}

    def allreduce(flat: torch.Tensor) -> None:  # this rank plus a peer that used a, not b
        n = a.numel()
        flat[:n] += peer["a"].reshape(-1)
        flat[-2] += 1.0

    sum_newly_trainable([a, b], allreduce)
    assert torch.equal(a.grad, torch.full_like(a, 3.0)) and b.grad is None


def test_a_sharded_layout_refuses_a_change_in_one_line():
    model = _model()
    layout = BucketLayout(model, bucket_cap_mb=None, first_bucket_cap_mb=None, shard="optimizer")
    assert not layout.usage.rides and all(b.storage is b.buffer for b in layout.buckets)  # flags apart
    model[2].requires_grad_(False)
    with pytest.raises(UsageError, match=r"^2\.weight\.requires_grad changed after prepare\(shard='optimizer'\)"):
        layout.before_step()


def test_sharded_flags_are_summed_apart_and_only_noted():
    """Under shard= the flags ride in no bucket: after_sum sums them with the allreduce it is
    given, and a parameter nobody used keeps its gradient (the sharded optimizer skips its piece)."""
    model = _model()
    layout = BucketLayout(model, bucket_cap_mb=None, first_bucket_cap_mb=None, shard="optimizer")
    usage, sums = layout.usage, []
    for param in usage.params[:2]:
        usage.landed(param)
    assert not layout.after_sum(lambda flat: sums.append(flat.tolist()))
    assert sums == [[1.0, 1.0, 0.0, 0.0]]  # this rank's flags, as sent; the fake peer adds nothing
    assert usage.unused == {id(p) for p in usage.params[2:]}
    assert all(p.grad is not None for p in usage.params)


def test_unfrozen_inside_a_step_and_reached_by_nobody_stays_without_a_gradient():
    model = _model()
    model[0].requires_grad_(False)
    layout = BucketLayout(model, bucket_cap_mb=None, first_bucket_cap_mb=None, shard="none")
    for param in layout.usage.params:
        layout.usage.landed(param)
    model[0].requires_grad_(True)  # after zero_grad; no backward reached it

    def allreduce(flat: torch.Tensor) -> None:  # one peer, which did not reach it either
        pass

    assert layout.after_sum(allreduce)
    assert model[0].weight.grad is None and model[0].bias.grad is None  # as on one device: the optimizer skips it
    assert model[2].weight.grad is not None
    layout.before_step()  # the next zero_grad: still None (its next landing takes its slot)
    assert model[0].weight.grad is None


def _sync(layout: BucketLayout, landed: list, *, set_to_none: bool) -> list:
    """One step of a lone rank: zero_grad, `landed` land, the sync's take_back and sum; what was dropped."""
    layout.before_step(set_to_none=set_to_none)
    layout.zero()
    for param in landed:
        layout.usage.landed(param)
    layout.usage.take_back()
    if layout.usage.rides:
        layout.usage.write_flags()  # (the sum of a lone rank's flags is its own)
    layout.after_sum(lambda flat: None)
    return [param for param in layout.usage.params if id(param) in layout.usage.unused]


@pytest.mark.parametrize("shard", ["none", "optimizer"])
def test_a_gradient_held_before_backward_is_kept_where_nobody_used_it(shard):
    """One device's optimizer steps a zero gradient (zero_grad(set_to_none=False)) and skips None
    (zero_grad()): a parameter no rank used is dropped (sharded: noted unused) only where it
    counted as None, and one dropped at the last sync stays None under set_to_none=False."""
    layout = BucketLayout(_model(), bucket_cap_mb=None, first_bucket_cap_mb=None, shard=shard)
    params = layout.usage.params
    head, tail = params[:2], params[2:]
    assert _sync(layout, params, set_to_none=False) == []
    assert _sync(layout, head, set_to_none=False) == []  # tail: zeros before backward, kept
    assert all(p.grad is not None and not p.grad.any() for p in tail)
    assert _sync(layout, head, set_to_none=True) == tail  # tail: None before backward
    assert _sync(layout, head, set_to_none=False) == tail  # still None: zero_grad(set_to_none=False) keeps None
    if shard == "none":
        assert all(p.grad is None for p in tail)
    assert _sync(layout, params, set_to_none=True) == []
