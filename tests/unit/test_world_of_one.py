"""A world of one pays nothing for data parallelism, and an epoch reads no device value until it ends.
Both are checked here on the CPU: the machinery DataParallel builds (none), the
numbers it produces (the plain loop's, bitwise), and every host read of a tensor during an epoch
(counted by patching the methods that read one). tests/gpu/test_one_gpu.py runs the same epoch
under `torch.cuda.set_sync_debug_mode("error")`, where such a read would raise."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from phalanx.models import LeNet
from phalanx.data_parallel import DataParallel, DataParallelConfig
from phalanx.data_parallel.guards.checks import check_finite
from phalanx.train import train_batch
from phalanx.data_parallel.strategy import DataSplit
from phalanx.train.loop import _on_device, train_epoch
from phalanx.runtime.world import World

WORLD1 = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
               backend="none", timeout_s=10.0)


def _batches(sizes=(16, 16, 7), seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.rand(n, 1, 28, 28, generator=gen, dtype=torch.float64), torch.randint(0, 10, (n,), generator=gen))
            for n in sizes]


def _hooks(param: torch.nn.Parameter) -> int:
    return len(getattr(param, "_post_accumulate_grad_hooks", None) or {})


@pytest.mark.parametrize("overlap", [True, False])
def test_a_world_of_one_builds_no_exchange_machinery(overlap):
    threads_before = {t.name for t in threading.enumerate()}
    with DataParallel(LeNet().double(), world=WORLD1, options=DataParallelConfig(overlap=overlap)) as dp:
        assert not dp.exchanging and dp.buckets == [] and dp._comm is None and dp._scheduler is None
        assert all(_hooks(p) == 0 for p in dp.module.parameters())
        X, y = _batches()[0]
        train_batch(dp, torch.optim.SGD(dp.module.parameters(), lr=0.1), X, y, global_batch_size=16)
        assert {t.name for t in threading.enumerate()} - threads_before == set()  # no communication thread
        assert set(dp.named_gradients()) == {f"{n}'s gradient" for n, _ in dp.module.named_parameters()}
        dp.zero_grad()
        assert all(p.grad is None for p in dp.module.parameters())  # as optimizer.zero_grad() leaves them
    # exchange_alone keeps the machinery (its collectives return at once), closed with the replica.
    with DataParallel(LeNet(), world=WORLD1, options=DataParallelConfig(overlap=True, exchange_alone=True)) as dp:
        assert dp.exchanging and len(dp.buckets) == 1 and dp._comm is not None  # native's 25 MB: LeNet whole
        assert all(_hooks(p) == 1 for p in dp.module.parameters())
    assert dp._comm is None


@pytest.mark.parametrize("grad_accum_steps", [1, 3])
def test_a_world_of_one_trains_bitwise_like_the_plain_loop_and_the_bucketed_replica(grad_accum_steps):
    torch.manual_seed(0)
    base = LeNet().double()
    plain = LeNet().double()
    plain.load_state_dict(base.state_dict())
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    models = {}
    for name, options in (("one", DataParallelConfig()), ("bucketed", DataParallelConfig(exchange_alone=True))):
        model = LeNet().double()
        model.load_state_dict(base.state_dict())
        models[name] = DataParallel(model, world=WORLD1, options=options)
    optimizers = {name: torch.optim.SGD(dp.module.parameters(), lr=0.1) for name, dp in models.items()}
    for X, y in _batches():
        plain_opt.zero_grad()
        plain_loss = F.cross_entropy(plain(X), y, reduction="sum")
        (plain_loss / X.shape[0]).backward()
        plain_opt.step()
        for name, dp in models.items():
            loss_sum, correct = train_batch(dp, optimizers[name], X, y, global_batch_size=X.shape[0],
                                            grad_accum_steps=grad_accum_steps)
            assert loss_sum.dtype == torch.float64 and correct.dtype == torch.long
            if grad_accum_steps == 1:
                assert torch.equal(loss_sum, plain_loss.detach().double())
    for dp in models.values():
        dp.close()
    for name, dp in models.items():
        for (key, a), b in zip(dp.module.state_dict().items(), plain.state_dict().values()):
            if grad_accum_steps == 1:
                assert torch.equal(a, b), (name, key)  # the plain loop's step, bit for bit
            else:  # micro-batches sum in another order
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=f"{name} {key}")
    for a, b in zip(models["one"].module.parameters(), models["bucketed"].module.parameters()):
        assert torch.equal(a, b)  # zero + g == g: a bucket view changes no bit


def test_check_finite_names_the_parameter_in_a_world_of_one():
    with DataParallel(LeNet().double(), world=WORLD1) as dp:
        X, y = _batches()[0]
        dp.zero_grad()
        F.cross_entropy(dp(X), y).backward()
        dp.module.fc1.bias.grad[3] = float("nan")
        with pytest.raises(FloatingPointError, match="fc1.bias's gradient holds NaN/Inf at step 4 on rank 0"):
            check_finite(loss=None, buffers=dp.named_gradients(), step=4, rank=0)


_HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")


def test_an_epoch_reads_no_tensor_value_on_the_host_until_its_last_step_is_done(monkeypatch):
    """Each of these reads synchronises a GPU with the host; inside an epoch none may happen."""
    torch.manual_seed(0)
    images = torch.randint(0, 256, (70, 1, 28, 28), dtype=torch.uint8)
    labels = torch.randint(0, 10, (70,))
    progress = {"done": 0, "total": None}
    reads: list[tuple[str, int]] = []

    def on_step(done: int, total: int) -> None:
        progress.update(done=done, total=total)

    for name in _HOST_READS:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, __name=name, __original=original, **kwargs):
            reads.append((__name, progress["done"]))
            return __original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counting)
    with DataParallel(LeNet(), world=WORLD1) as dp:
        optimizer = torch.optim.SGD(dp.module.parameters(), lr=0.1)
        stats = train_epoch(DataSplit(dp), optimizer, images, labels, world=WORLD1, global_batch_size=16, seed=0, epoch=0,
                            on_step=on_step)
    monkeypatch.undo()
    assert progress == {"done": 5, "total": 5} and stats.num_examples == 70
    inside = [(name, done) for name, done in reads if done < progress["total"]]
    assert inside == [], f"host reads inside the epoch (name, steps done): {inside[:5]}"
    assert 1 <= len(reads) <= 3, reads  # the epoch's totals, read once after the last step


def test_the_epoch_order_moves_to_the_device_once_with_its_batches_intact():
    batches = list(torch.split(torch.randperm(37, generator=torch.Generator().manual_seed(0)), 8))
    assert _on_device(batches, torch.device("cpu")) is batches  # nothing to move
    moved = _on_device(batches, torch.device("meta"))  # a device without data: shapes and storage only
    assert [b.device.type for b in moved] == ["meta"] * 5 and [b.numel() for b in moved] == [8, 8, 8, 8, 5]
    assert len({b.untyped_storage().data_ptr() for b in moved}) == 1  # views of one copy of the order
