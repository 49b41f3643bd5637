"""Bucketed overlap without processes: bucket layout, the launch-in-order rule, the one wait point,
no_sync, and gradient accumulation, checked in a world of size 1 with a fake comm that records
every launch (which bucket, and how far backward had got when it launched)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from phalanx.cli import build_parser
from phalanx.errors import UsageError
from phalanx.models import LeNet
from phalanx.data_parallel import DEFAULT_BUCKET_CAP_MB, DataParallel, OverlapScheduler
from phalanx.data_parallel.buckets import DDP_FIRST_BUCKET_BYTES, build_buckets, default_first_cap_bytes
from phalanx.data_parallel.step import micro_batches
from phalanx.data_parallel.config import DataParallelConfig
from phalanx.job.config import TrainConfig
from phalanx.options import build
from phalanx.train import train_batch
from phalanx.runtime.world import World

KB = 1024
WORLD1 = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
               backend="none", timeout_s=10.0)


class FakeHandle:
    def __init__(self, log: list, name) -> None:
        self.waited = False
        self._log, self._name = log, name

    def wait(self):
        assert not self.waited, "waited twice"
        self.waited = True
        self._log.append(("wait", self._name))


class FakeComm:
    """Records each launch: the bucket (by buffer address) and a snapshot taken at launch time."""

    def __init__(self, snapshot=lambda: None) -> None:
        self.log: list = []
        self.handles: list[FakeHandle] = []
        self.snapshot = snapshot
        self.buffers: list[torch.Tensor] = []

    def bucket_of(self, tensor: torch.Tensor) -> int:
        return next(i for i, b in enumerate(self.buffers) if b.data_ptr() == tensor.data_ptr())

    def allreduce_async(self, tensor: torch.Tensor, *, algorithm: str = "native", tag=None,
                        on_done=None) -> FakeHandle:
        index = self.bucket_of(tensor)
        self.log.append(("launch", index, self.snapshot()))
        self.handles.append(FakeHandle(self.log, index))
        return self.handles[-1]

    def launches(self) -> list[int]:
        return [entry[1] for entry in self.log if entry[0] == "launch"]

    def allreduce(self, tensor: torch.Tensor, *, algorithm: str = "native", tag=None) -> torch.Tensor:
        """The NaN/Inf check's synchronous sum (close() makes one): a world of one's is its own."""
        return tensor


def _dp(model: nn.Module, comm: FakeComm, **options) -> DataParallel:
    options.setdefault("bucket_cap_mb", DEFAULT_BUCKET_CAP_MB)  # LeNet in 3 buckets (auto, native here: one)
    dp = DataParallel.over(comm, model, world=WORLD1, options=DataParallelConfig(**options))
    comm.buffers = [b.buffer for b in dp.buckets]
    return dp


def _batch(n=8, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, 28, 28, generator=gen, dtype=dtype), torch.randint(0, 10, (n,), generator=gen)


# --- bucket layout -------------------------------------------------------------------------

def test_default_cap_cuts_lenet_into_three_buckets_last_layer_first():
    model = LeNet()
    buckets = build_buckets(list(model.parameters()), cap_bytes=int(DEFAULT_BUCKET_CAP_MB * 1024 * KB))
    names = {id(p): n for n, p in model.named_parameters()}
    assert [[names[id(p)] for p in b.params] for b in buckets] == [
        ["fc2.bias", "fc2.weight", "fc1.bias"],
        ["fc1.weight"],  # 400 KB: alone, over the cap (a single tensor may exceed it)
        ["conv2.bias", "conv2.weight", "conv1.bias", "conv1.weight"],
    ]
    assert sum(b.size_bytes for b in buckets) == 129_068 * 4
    for bucket in buckets:
        assert bucket.size_bytes <= 256 * KB or len(bucket.params) == 1
        offsets = [0] + [sum(p.numel() for p in bucket.params[:i]) for i in range(1, len(bucket.params))]
        assert bucket.offsets == offsets


def test_first_bucket_has_its_own_cap():
    model = LeNet()
    params = list(model.parameters())
    # 6,000 B holds fc2 (5,160 B) and fc1.bias (512 B); the rest use the 0.5 MB cap.
    buckets = build_buckets(params, cap_bytes=512 * KB, first_cap_bytes=6000)
    assert buckets[0].params == [model.fc2.bias, model.fc2.weight, model.fc1.bias]
    assert buckets[1].params[0] is model.fc1.weight and len(buckets) == 2
    assert [p for b in buckets for p in b.params] == list(reversed(params))
    # A tiny first cap leaves the last bias alone in the first bucket.
    assert build_buckets(params, cap_bytes=512 * KB, first_cap_bytes=1)[0].params == [model.fc2.bias]


def test_ddp_first_bucket_rule():
    assert default_first_cap_bytes(None) is None
    assert default_first_cap_bytes(100) == 100
    assert default_first_cap_bytes(25 * 1024 * KB) == DDP_FIRST_BUCKET_BYTES == 1024 * KB
    with pytest.raises(ValueError, match="cap_bytes must be at least 1"):
        build_buckets(list(LeNet().parameters()), cap_bytes=0)


def test_dataparallel_bucket_options():
    assert len(_dp(LeNet(), FakeComm(), bucket_cap_mb=None).buckets) == 1
    assert len(_dp(LeNet(), FakeComm()).buckets) == 3
    with pytest.raises(ValueError, match="--bucket-cap-mb 0 must be a positive"):
        DataParallelConfig(bucket_cap_mb=0, overlap=False)
    with pytest.raises(ValueError, match="--allreduce .carrier-pigeon. is unknown; choose one of auto, native, shm"):
        DataParallelConfig(allreduce="carrier-pigeon", overlap=False)
    with pytest.raises(ValueError, match="first_bucket_cap_mb must be a positive number of MB .or None., got 0"):
        DataParallelConfig(first_bucket_cap_mb=0)


# --- the scheduler alone -------------------------------------------------------------------

def _scheduler(sizes=(1, 2, 1)):
    """A scheduler over buckets of `sizes` one-element params, with a recording fake comm."""
    groups = [[nn.Parameter(torch.zeros(1)) for _ in range(size)] for size in sizes]
    buckets = []
    for index, group in enumerate(groups):
        (bucket,) = build_buckets(list(reversed(group)))  # reversed back: params in group order
        bucket.index = index
        buckets.append(bucket)
    comm = FakeComm()
    comm.buffers = [b.buffer for b in buckets]
    return OverlapScheduler(buckets, launch=lambda b: comm.allreduce_async(b.buffer)), groups, comm


def test_buckets_launch_in_order_even_when_a_later_one_is_ready_first():
    scheduler, groups, comm = _scheduler()
    scheduler.mark_ready(groups[2][0])  # bucket 2 complete first: must wait for 0 and 1
    assert comm.launches() == []
    scheduler.mark_ready(groups[1][0])  # bucket 1 half done
    scheduler.mark_ready(groups[0][0])  # bucket 0 complete: launches 0 only
    assert comm.launches() == [0]
    scheduler.mark_ready(groups[1][1])  # bucket 1 complete: 1, then the waiting 2
    assert comm.launches() == [0, 1, 2]
    assert scheduler.in_flight and not any(h.waited for h in comm.handles)
    scheduler.finish()
    assert comm.log[-3:] == [("wait", 0), ("wait", 1), ("wait", 2)]
    assert all(h.waited for h in comm.handles) and not scheduler.in_flight


def test_finish_launches_buckets_that_never_became_ready_then_waits_each_once():
    scheduler, groups, comm = _scheduler()
    scheduler.mark_ready(groups[2][0])  # 0 and 1 never complete (unused params, empty shard)
    scheduler.finish()
    assert comm.launches() == [0, 1, 2]
    assert [e for e in comm.log if e[0] == "wait"] == [("wait", 0), ("wait", 1), ("wait", 2)]
    scheduler.finish()  # next step with no backward at all: everything launched by finish
    assert comm.launches() == [0, 1, 2, 0, 1, 2] and all(h.waited for h in comm.handles)


def test_a_gradient_landing_twice_is_refused():
    scheduler, groups, _ = _scheduler()
    scheduler.mark_ready(groups[0][0])  # bucket 0 launched
    with pytest.raises(RuntimeError, match="landed twice"):
        scheduler.mark_ready(groups[0][0])
    scheduler.mark_ready(groups[1][0])
    with pytest.raises(RuntimeError, match="landed twice"):  # not launched yet, still a repeat
        scheduler.mark_ready(groups[1][0])


class DoublingHandle(FakeHandle):
    """Two ranks holding the same gradient: the sum is twice this rank's buffer."""

    def __init__(self, log: list, name, buffer: torch.Tensor) -> None:
        super().__init__(log, name)
        self._buffer = buffer

    def wait(self):
        super().wait()
        self._buffer.mul_(2)


def test_settle_sums_what_landed_sets_it_aside_and_finish_adds_it_back():
    scheduler, groups, comm = _scheduler()
    handles = []

    def launch(bucket):
        handles.append(DoublingHandle(comm.log, bucket.index, bucket.buffer))
        comm.log.append(("launch", bucket.index, None))
        return handles[-1]
    scheduler._launch_fn = launch
    params = [p for group in groups for p in group]
    for value, param in enumerate(params, start=1):  # the first backward: gradients 1, 2, 3, 4
        param.grad += value
    scheduler.mark_ready(groups[0][0])  # bucket 0 on the wire; 1 half landed; 2 not yet
    scheduler.mark_ready(groups[1][0])
    assert scheduler.started and comm.launches() == [0]
    scheduler.settle()  # a second forward: every bucket summed now, in order, and set aside
    assert comm.launches() == [0, 1, 2] and all(h.waited for h in handles)
    assert not scheduler.in_flight and not scheduler.started
    assert all(float(p.grad) == 0.0 for p in params)  # the buckets are zeroed for the next backward
    for param in params:  # the second backward: gradient 10 everywhere, landing in buckets off the wire
        param.grad += 10
        scheduler.mark_ready(param)
    assert comm.launches() == [0, 1, 2, 0, 1, 2]
    scheduler.finish()
    # Sum of the sums, 2 x first + 2 x second: a sum of the first sum again would give 4 x first + 2 x second.
    assert [float(p.grad) for p in params] == [2 * v + 20 for v in (1, 2, 3, 4)]
    for param in params:  # the next step owes nothing to the last one's carried sums
        param.grad.zero_()
    scheduler.mark_ready(groups[0][0])
    scheduler.finish()
    assert [float(p.grad) for p in params] == [0.0] * 4


def test_a_handle_already_waited_trips_the_assertion():
    scheduler, groups, comm = _scheduler()
    scheduler.mark_ready(groups[0][0])
    comm.handles[0].wait()  # someone else waited it
    with pytest.raises(AssertionError, match="waited before finish"):
        scheduler.finish()
    assert not scheduler.in_flight  # state is reset even after a failed finish


# --- DataParallel's hooks, world of size 1 -------------------------------------------------

def test_hooks_launch_each_bucket_during_backward_in_order():
    torch.manual_seed(0)
    model = LeNet().double()
    # conv1's gradient at each launch (None until it lands, as on one device: 0)
    comm = FakeComm(snapshot=lambda: float(g.abs().sum()) if (g := model.conv1.weight.grad) is not None else 0.0)
    dp = _dp(model, comm)
    reference = LeNet().double()
    reference.load_state_dict(model.state_dict())
    X, y = _batch()
    dp.zero_grad()
    (F.cross_entropy(dp(X), y, reduction="sum") / 8).backward()
    assert comm.launches() == [0, 1, 2]  # all launched by hooks, before any wait
    assert not any(h.waited for h in comm.handles)
    # Buckets 0 and 1 (fc layers) went out while backward had not reached conv1 yet.
    assert [entry[2] for entry in comm.log[:2]] == [0.0, 0.0]
    assert comm.log[2][2] > 0  # the conv bucket launches only once conv1's gradient landed
    dp.finish_gradient_sync()
    assert [e for e in comm.log if e[0] == "wait"] == [("wait", 0), ("wait", 1), ("wait", 2)]
    (F.cross_entropy(reference(X), y, reduction="sum") / 8).backward()
    for p, q in zip(dp.module.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_two_forwards_and_backwards_in_one_step_are_summed_apart_as_dcgans_discriminator():
    torch.manual_seed(0)
    model = LeNet().double()
    reference = LeNet().double()
    reference.load_state_dict(model.state_dict())
    comm = FakeComm()
    dp = _dp(model, comm, overlap=True)
    (X, y), (X2, y2) = _batch(seed=1), _batch(seed=2)
    for step in range(2):
        dp.zero_grad()
        F.cross_entropy(dp(X), y, reduction="sum").backward()  # D on real images: buckets go out
        assert comm.launches()[-3:] == [0, 1, 2] and dp.exchange_in_flight
        F.cross_entropy(dp(X2), y2, reduction="sum").backward()  # D on fakes: a forward settled the first
        dp.finish_gradient_sync()
        assert comm.launches() == [0, 1, 2] * 2 * (step + 1) and all(h.waited for h in comm.handles)
    reference.zero_grad()
    F.cross_entropy(reference(X), y, reduction="sum").backward()
    F.cross_entropy(reference(X2), y2, reduction="sum").backward()
    for p, q in zip(dp.module.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-15, atol=1e-15)
    dp.zero_grad()  # two backwards through one forward have no forward to settle at: still one line
    loss = F.cross_entropy(dp(X), y, reduction="sum")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"landed twice in bucket .*of one forward \(retain_graph=True\)"):
        loss.backward()
    dp.zero_grad()  # a siamese pair's two forwards, then two backwards: named, with the fixes
    a, b = dp(X), dp(X2)
    F.cross_entropy(a, y, reduction="sum").backward()
    with pytest.raises(RuntimeError) as caught:
        F.cross_entropy(b, y2, reduction="sum").backward()
    line = str(caught.value)
    assert "\n" not in line
    for said in ("forward a, forward b, backward a, backward b", "add the losses and call backward once",
                 "overlap=False", "dp.no_sync()"):
        assert said in line, line
    dp.zero_grad()
    with dp.no_sync():  # the fix the line names: the first backward accumulates, the second sends the sum
        F.cross_entropy(dp(X), y, reduction="sum").backward()
    F.cross_entropy(dp(X2), y2, reduction="sum").backward()
    dp.finish_gradient_sync()
    for p, q in zip(dp.module.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-15, atol=1e-15)
    dp.zero_grad()
    dp.close()


def test_no_sync_launches_nothing_accumulates_and_restores_on_error():
    torch.manual_seed(0)
    comm = FakeComm()
    dp = _dp(LeNet().double(), comm)
    X, y = _batch()
    dp.zero_grad()
    with dp.no_sync():
        for half in (slice(0, 4), slice(4, 8)):
            F.cross_entropy(dp(X[half]), y[half], reduction="sum").backward()
        dp.finish_gradient_sync()  # inside no_sync: nothing to do
    assert comm.log == [] and dp.sync_enabled
    accumulated = [p.grad.clone() for p in dp.module.parameters()]
    dp.finish_gradient_sync()  # no synced backward ran: finish launches every bucket itself
    assert comm.launches() == [0, 1, 2] and all(h.waited for h in comm.handles)
    dp.zero_grad()
    with dp.no_sync():
        F.cross_entropy(dp(X), y, reduction="sum").backward()  # the full batch at once
    for acc, p in zip(accumulated, dp.module.parameters()):
        torch.testing.assert_close(acc, p.grad, rtol=1e-12, atol=1e-14)

    with pytest.raises(KeyError):
        with dp.no_sync():
            raise KeyError("boom")
    assert dp.sync_enabled
    with dp.no_sync():  # nesting restores the outer value, not True
        with pytest.raises(KeyError):
            with dp.no_sync():
                raise KeyError("boom")
        assert not dp.sync_enabled
    assert dp.sync_enabled


def test_unused_parameter_bucket_launches_at_finish_and_later_buckets_wait_for_it():
    class WithUnusedHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.lenet = LeNet()
            self.extra = nn.Linear(10, 10)  # registered last, so it sits in bucket 0

        def forward(self, x):
            return self.lenet(x)

    comm = FakeComm()
    dp = _dp(WithUnusedHead().double(), comm, first_bucket_cap_mb=880 / 2**20)  # extra's 110 doubles
    assert [id(p) for p in dp.buckets[0].params] == [id(dp.module.extra.bias), id(dp.module.extra.weight)]
    X, y = _batch()
    dp.zero_grad()
    F.cross_entropy(dp(X), y, reduction="sum").backward()
    assert comm.launches() == []  # every other bucket is ready but must not overtake bucket 0
    dp.finish_gradient_sync()
    assert comm.launches() == list(range(len(dp.buckets)))
    # Summed all the same (zeros), but no rank used it: no gradient, as on one device (usage.py).
    assert torch.count_nonzero(dp.buckets[0].buffer) == 0
    assert dp.module.extra.weight.grad is None and dp.module.extra.bias.grad is None
    assert dp.module.lenet.conv1.weight.grad is not None
    dp.zero_grad()  # None stays None, as torch's zero_grad leaves it; the next landing takes its slot back
    assert dp.module.extra.weight.grad is None
    dp.module.extra(torch.ones(1, 10, dtype=torch.float64)).sum().backward()
    assert dp.module.extra.weight.grad.data_ptr() == dp.buckets[0].buffer.data_ptr() + 10 * 8


def test_empty_shard_still_launches_every_bucket():
    comm = FakeComm()
    dp = _dp(LeNet().double(), comm)
    optimizer = torch.optim.SGD(dp.module.parameters(), lr=0.1)
    X, y = _batch(0)
    loss_sum, correct = train_batch(dp, optimizer, X, y, global_batch_size=5, grad_accum_steps=2)
    assert comm.launches() == [0, 1, 2] and all(h.waited for h in comm.handles)
    assert loss_sum.item() == 0 and correct.item() == 0


def test_misuse_is_refused():
    comm = FakeComm()
    dp = _dp(LeNet().double(), comm)
    X, y = _batch()
    dp.zero_grad()
    F.cross_entropy(dp(X), y).backward()
    dp.zero_grad()  # gradients no update used: summed (buckets on the wire waited), then zeroed, never mid-flight
    assert comm.handles and all(h.waited for h in comm.handles) and not dp.exchange_in_flight
    assert not any(bucket.buffer.any() for bucket in dp.buckets)
    F.cross_entropy(dp(X), y).backward()
    with pytest.raises(RuntimeError, match="in flight"):
        with dp.no_sync():
            pass
    dp.finish_gradient_sync()
    dp.zero_grad()
    F.cross_entropy(dp(X), y).backward()
    dp.finish_gradient_sync()
    alone = dp.module.fc1.weight.grad.clone()
    dp.zero_grad()
    dp.module.fc1.weight.grad = torch.full_like(dp.module.fc1.weight, 2.0)  # a tensor of the user's in its place
    F.cross_entropy(dp(X), y).backward()
    dp.finish_gradient_sync()  # taken back into the bucket, as one device would have added to it
    assert dp.module.fc1.weight.grad.data_ptr() == dp.buckets[1].buffer[dp.buckets[1].offsets[0]:].data_ptr()
    torch.testing.assert_close(dp.module.fc1.weight.grad, alone + 2.0, rtol=0, atol=1e-15)
    dp.close()
    assert comm.handles and all(h.waited for h in comm.handles)
    with pytest.raises(RuntimeError, match="closed"):
        dp.finish_gradient_sync()


@pytest.mark.parametrize("overlap", [False, True])
def test_gradients_written_before_their_sum_are_refused_once_summed_and_written_after_it_are_fine(overlap):
    """torch's clip_grad_norm_ before finish_gradient_sync() clips each rank's share by its own norm."""
    torch.manual_seed(0)
    comm = FakeComm()
    dp = _dp(LeNet().double(), comm, overlap=overlap)
    X, y = _batch()
    for clip_first in (False, True, False):
        dp.zero_grad()
        F.cross_entropy(dp(X), y, reduction="sum").backward()
        if not clip_first:
            dp.finish_gradient_sync()
            torch.nn.utils.clip_grad_norm_(dp.parameters(), 1e-3)  # after the sum: the clip of the sum
            continue
        torch.nn.utils.clip_grad_norm_(dp.parameters(), 1e-3)
        with pytest.raises(UsageError, match=r"^the gradients of fc2.bias and 7 more were written in place between "
                           r"backward and finish_gradient_sync\(\) \(torch.nn.utils.clip_grad_norm_ before the sync\?\): "
                           r"each rank changed its own unsummed share, .* call dp.finish_gradient_sync\(\) right after "
                           r"backward, then clip and step \(a register_post_accumulate_grad_hook .*\)$"):
            dp.finish_gradient_sync()
        assert all(h.waited for h in comm.handles) and not dp.exchange_in_flight  # refused once every sum is done
    dp.zero_grad()
    F.cross_entropy(dp(X), y, reduction="sum").backward()
    dp.module.conv1.weight.grad.mul_(0.5)  # a write into the conv bucket only: its parameters are named
    with pytest.raises(UsageError, match="^the gradients of conv2.bias and 3 more were written"):
        dp.finish_gradient_sync()
    dp.zero_grad()
    with dp.no_sync():  # accumulation, a second forward, a take-back: the replica's own writes are no script's
        F.cross_entropy(dp(X), y, reduction="sum").backward()
    dp.module.fc1.weight.grad = None
    F.cross_entropy(dp(X), y, reduction="sum").backward()
    F.cross_entropy(dp(X), y, reduction="sum").backward() if not overlap else None
    dp.finish_gradient_sync()
    dp.close()


def test_close_removes_the_hooks():
    comm = FakeComm()
    dp = _dp(LeNet().double(), comm)
    dp.close()
    X, y = _batch()
    F.cross_entropy(dp(X), y).backward()
    assert comm.log == []


# --- gradient accumulation -----------------------------------------------------------------

@pytest.mark.parametrize("n, steps, sizes", [(10, 3, [4, 3, 3]), (9, 3, [3, 3, 3]), (2, 3, [1, 1, 0]),
                                             (0, 2, [0, 0]), (5, 1, [5])])
def test_micro_batch_sizes(n, steps, sizes):
    X, y = torch.arange(n).float(), torch.arange(n)
    pieces = micro_batches(X, y, steps)
    assert [len(px) for px, _ in pieces] == sizes
    assert torch.equal(torch.cat([py for _, py in pieces]), y)  # contiguous, in order
    assert all(torch.equal(px.long(), py) for px, py in pieces)


def test_micro_batches_rejects_zero():
    with pytest.raises(ValueError, match="at least 1, got 0"):
        micro_batches(torch.zeros(3), torch.zeros(3), 0)


@pytest.mark.parametrize("overlap", [True, False])
def test_grad_accum_three_equals_one_and_syncs_once(overlap):
    X, y = _batch(11)
    results = {}
    for steps in (1, 3):
        torch.manual_seed(0)
        comm = FakeComm()
        dp = _dp(LeNet().double(), comm, overlap=overlap)
        optimizer = torch.optim.SGD(dp.module.parameters(), lr=0.1)
        loss_sum, correct = train_batch(dp, optimizer, X, y, global_batch_size=11, grad_accum_steps=steps)
        results[steps] = ([p.detach().clone() for p in dp.module.parameters()], loss_sum, correct)
        assert comm.launches() == [0, 1, 2]  # one exchange per step, through the one send path either way
    for a, b in zip(results[1][0], results[3][0]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(results[1][1], results[3][1], rtol=1e-12, atol=0)
    assert results[1][2] == results[3][2]


# --- config and flags ----------------------------------------------------------------------

def test_config_and_cli_flags():
    config = TrainConfig().data_parallel
    assert config.overlap is None and config.bucket_cap_mb == "auto" and config.grad_accum_steps == 1
    for kwargs, fragment in [({"grad_accum_steps": 0}, "--grad-accum 0"), ({"bucket_cap_mb": -1.0}, "--bucket-cap-mb -1.0")]:
        with pytest.raises(ValueError, match=fragment):
            DataParallelConfig(**kwargs)
    args = build_parser().parse_args(["train", "--no-overlap", "--bucket-cap-mb", "none", "--grad-accum", "4"])
    config = build(TrainConfig, args).data_parallel
    assert (config.overlap, config.bucket_cap_mb, config.grad_accum_steps) == (False, None, 4)
    config = build(TrainConfig, build_parser().parse_args(["train", "--bucket-cap-mb", "0.1"])).data_parallel
    assert (config.overlap, config.bucket_cap_mb) == (None, 0.1)  # auto
    config = build(TrainConfig, build_parser().parse_args(["train", "--overlap"])).data_parallel
    assert config.overlap is True


def test_overlap_auto_is_off_for_shm_only_where_no_core_is_left_for_the_thread():
    from phalanx.data_parallel.config import auto_overlap

    assert auto_overlap(algorithm="shm", workers=2, threads=1, cores=2) == (
        False, "2 workers x 1 thread on 2 cores leave no core for a communication thread")
    assert auto_overlap(algorithm="shm", workers=8, threads=1, cores=16) == (
        True, "8 workers x 1 thread on 16 cores leave a core per worker for a communication thread")
    assert auto_overlap(algorithm="shm", workers=1, threads=2, cores=2)[0] is False
    for algorithm in ("native", "hierarchical", "ring", "tree", "naive"):  # waits the thread hides cost no core
        assert auto_overlap(algorithm=algorithm, workers=2, threads=1, cores=2) == (True, None)


def test_resolve_overlap_asks_auto_with_this_process_s_cores_threads_and_sharers(monkeypatch):
    from phalanx.data_parallel import config as dp_config
    from phalanx.data_parallel.config import resolve_overlap

    monkeypatch.setattr(dp_config, "available_cores", lambda: 2)
    monkeypatch.setattr(dp_config.torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(dp_config, "workers_sharing_cores", lambda workers: workers)
    assert resolve_overlap(None, algorithm="shm", local_workers=2) == (
        False, "2 workers x 1 thread on 2 cores leave no core for a communication thread")
    assert resolve_overlap(None, algorithm="shm", local_workers=1) == (
        True, "1 worker x 1 thread on 2 cores leaves a core for a communication thread")
    monkeypatch.setattr(dp_config, "workers_sharing_cores", lambda workers: 1)  # --bind-cores: its own share
    assert resolve_overlap(None, algorithm="shm", local_workers=2)[0] is True
    assert resolve_overlap(None, algorithm="native", local_workers=2) == (True, None)
    assert resolve_overlap(True, algorithm="shm", local_workers=2) == (True, None)  # given: as given
    assert resolve_overlap(False, algorithm="native", local_workers=2) == (False, None)


def test_the_first_line_says_what_overlap_auto_saw(monkeypatch):
    from phalanx.data_parallel import config as dp_config

    monkeypatch.setattr(dp_config, "leaves_core_for_comm", lambda **layout: False)
    # A world of one exchanging alone builds the k-device replica's buckets and choices.
    for overlap, algorithm, expected in ((None, "shm", False), (None, "native", True), (True, "shm", True)):
        options = DataParallelConfig(overlap=overlap, allreduce=algorithm, exchange_alone=True)
        with DataParallel(LeNet(), world=WORLD1, options=options) as dp:
            assert dp.overlap is expected and dp.choices.overlap is expected
            line = dp.choices.describe()
            said = "synchronous gradient exchange (auto: 1 worker x " if not expected else "overlapped gradient exchange in"
            assert said in line, line


@pytest.mark.parametrize("overlap, refusal", [(False, r"^phalanx.clip_grad_norm_ after a backward whose gradients "
                                                      r"were never summed across ranks: call dp.finish_gradient_sync"),
                                              (True, r"^clip_grad_norm_ while gradient allreduces are in flight")])
def test_phalanx_clip_before_the_sync_is_refused_at_the_call(overlap, refusal):
    """Without overlap nothing is in flight before finish_gradient_sync(): the clip used to go through
    and the sync then blamed torch's clip_grad_norm_ (found by an outside-user trial)."""
    from phalanx.data_parallel.clip import clip_grad_norm_

    torch.manual_seed(0)
    dp = _dp(LeNet().double(), FakeComm(), overlap=overlap)
    X, y = _batch()
    F.cross_entropy(dp(X), y, reduction="sum").backward()
    with pytest.raises(RuntimeError, match=refusal):
        clip_grad_norm_(dp, 1e-3)
    dp.finish_gradient_sync()
    assert clip_grad_norm_(dp, 1e-3) > 1e-3  # after the sum: the clip of the sum
    dp.close()


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("way", ["accumulate", "no_sync", "require_backward_grad_sync"])
def test_a_step_on_gradients_accumulated_unsummed_is_refused(overlap, way):
    """Accelerate's `accumulate` block ported as it is steps on every micro-batch (its optimizer
    skips the steps before the last; torch's does not): each rank stepped on its own unsummed
    gradient and the replicas drifted apart silently (found by an outside-user trial)."""
    torch.manual_seed(0)
    dp = _dp(LeNet().double(), FakeComm(), overlap=overlap)
    optimizer = torch.optim.SGD(dp.parameters(), lr=0.1)
    X, y = _batch()
    # Each way named, and nanoGPT's flag with its fix (the line named no_sync() and accumulate() alone).
    refusal = (r"^optimizer\.step\(\) on gradients accumulated with the sync off \(inside dp\.no_sync\(\), after "
               r"dp\.require_backward_grad_sync = False, or before dp\.accumulate\(\)'s last micro-batch\).*nanoGPT's "
               r"loop: dp\.require_backward_grad_sync = True before the last micro-batch's backward")
    with pytest.raises(RuntimeError, match=refusal):
        if way == "accumulate":
            for piece in dp.accumulate(2):
                F.cross_entropy(dp(X[piece::2]), y[piece::2], reduction="sum").backward()
                optimizer.step()
        elif way == "no_sync":
            with dp.no_sync():
                F.cross_entropy(dp(X), y, reduction="sum").backward()
                optimizer.step()
        else:
            dp.require_backward_grad_sync = False
            F.cross_entropy(dp(X), y, reduction="sum").backward()
            optimizer.step()
    dp.require_backward_grad_sync = True
    dp.zero_grad()  # the micro-batches so far dropped: nothing unsummed is left to refuse
    optimizer.step()
    for piece in dp.accumulate(2):  # the way: step once, after the last micro-batch's sync
        F.cross_entropy(dp(X[piece::2]), y[piece::2], reduction="sum").backward()
    dp.finish_gradient_sync()
    optimizer.step()
    with dp.no_sync():  # a no_sync() backward summed by the sync after it
        F.cross_entropy(dp(X), y, reduction="sum").backward()
    dp.finish_gradient_sync()
    optimizer.step()
    dp.close()
