"""Gradient buckets: reverse order, caps, grads as views, and the exact loss scaling of a step."""

import torch
import torch.nn.functional as F

from phalanx.models import LeNet, build_model
from phalanx.data_parallel.buckets import build_buckets, grads_are_bucket_views


def test_one_bucket_holds_all_grads_in_reverse_order():
    model = LeNet()
    params = list(model.parameters())
    buckets = build_buckets(params)
    assert len(buckets) == 1
    assert buckets[0].params == list(reversed(params))
    assert buckets[0].buffer.numel() == sum(p.numel() for p in params) == 129_068
    assert grads_are_bucket_views(buckets)


def test_backward_writes_into_the_bucket():
    torch.manual_seed(0)
    model = LeNet()
    buckets = build_buckets(list(model.parameters()))
    reference = LeNet()
    reference.load_state_dict(model.state_dict())
    x = torch.rand(8, 1, 28, 28)
    y = torch.randint(0, 10, (8,))
    F.cross_entropy(model(x), y).backward()
    F.cross_entropy(reference(x), y).backward()
    flat_ref = torch.cat([p.grad.reshape(-1) for p in reversed(list(reference.parameters()))])
    torch.testing.assert_close(buckets[0].buffer, flat_ref, rtol=0, atol=0)
    assert grads_are_bucket_views(buckets)


def test_cap_splits_buckets_and_first_is_last_layer():
    model = LeNet()
    buckets = build_buckets(list(model.parameters()), cap_bytes=100 * 1024)
    assert len(buckets) > 1
    assert buckets[0].params[0] is model.fc2.bias
    seen = [p for b in buckets for p in b.params]
    assert seen == list(reversed(list(model.parameters())))
    for bucket in buckets:  # a bucket exceeds the cap only when a single tensor does
        assert bucket.size_bytes <= 100 * 1024 or len(bucket.params) == 1


def test_replacing_a_grad_is_detected():
    model = LeNet()
    buckets = build_buckets(list(model.parameters()))
    model.fc1.weight.grad = torch.zeros_like(model.fc1.weight)
    assert not grads_are_bucket_views(buckets)


def test_sum_of_scaled_shard_grads_equals_full_batch_grad_on_uneven_split():
    """The loss rule of train_batch, checked without processes: 3 shards of 7, 6, 6 examples."""
    torch.manual_seed(1)
    model = build_model("lenet")
    x = torch.rand(19, 1, 28, 28)
    y = torch.randint(0, 10, (19,))
    F.cross_entropy(model(x), y).backward()
    full = [p.grad.clone() for p in model.parameters()]
    summed = [torch.zeros_like(p) for p in model.parameters()]
    for lo, hi in [(0, 7), (7, 13), (13, 19)]:
        model.zero_grad()
        (F.cross_entropy(model(x[lo:hi]), y[lo:hi], reduction="sum") / 19).backward()
        for acc, p in zip(summed, model.parameters()):
            acc += p.grad
    for a, b in zip(summed, full):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # ...whereas averaging per-shard means (the common bug) is measurably wrong here.
    wrong = [torch.zeros_like(p) for p in model.parameters()]
    for lo, hi in [(0, 7), (7, 13), (13, 19)]:
        model.zero_grad()
        (F.cross_entropy(model(x[lo:hi]), y[lo:hi]) / 3).backward()
        for acc, p in zip(wrong, model.parameters()):
            acc += p.grad
    assert max((a - b).abs().max().item() for a, b in zip(wrong, full)) > 1e-6


def test_book_init_matches_the_chapter():
    torch.manual_seed(0)
    model = build_model("lenet", init="book")
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            assert torch.count_nonzero(param) == 0
        else:
            assert abs(param.std().item() - 0.01) < 0.003


def test_a_gradient_replaced_or_moved_within_its_bucket_is_no_longer_its_view():
    model = LeNet()
    params = list(model.parameters())
    buckets = build_buckets(params, cap_bytes=100 * 1024)
    assert grads_are_bucket_views(buckets)
    bucket = buckets[-1]
    param = bucket.params[1]
    kept = param.grad
    param.grad = param.grad.clone()  # a script's own tensor: same values, other memory
    assert not grads_are_bucket_views(buckets)
    param.grad = bucket.buffer[:param.numel()].view_as(param)  # in the bucket, at another parameter's offset
    assert bucket.offsets[1] != 0 and not grads_are_bucket_views(buckets)
    param.grad = kept
    assert grads_are_bucket_views(buckets)
    param.grad = None
    assert not grads_are_bucket_views(buckets)
