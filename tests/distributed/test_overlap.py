"""Overlapped bucketed allreduce on 2 and 3 gloo processes gives the 1-process full-batch gradient.

One spawn per world size (start-up dominates): the worker runs every configuration - synchronous
flat and bucketed, overlapped with 1/3/5 buckets x native/ring/tree/naive, a tiny first bucket,
a parameter unused on some ranks, an empty shard, grad-accum 3 vs 1, and no_sync - and returns
the gradients; the parent compares them with gradients it computes in one process. float64, so
the only differences are summation order (~1e-16 relative). A counting wrapper around AsyncComm
shows when buckets launch: during backward (all of them, when every parameter is used), not
at all inside no_sync, and once per step with grad-accum. Synchronous and overlapped exchanges
are one send path on two schedules: their buckets are bitwise equal for every algorithm.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from phalanx.comm import ALGORITHMS, AsyncComm
from phalanx.data import rank_shard
from phalanx.models import LeNet
from phalanx.data_parallel import DataParallel, DataParallelConfig
from phalanx.train import train_batch
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

GLOBAL_BATCH = 37  # 19/18 on 2 ranks, 13/12/12 on 3: uneven on purpose
TOL = dict(rtol=1e-10, atol=1e-13)

# name -> the replica's options (DataParallelConfig); cap 0.25 MB gives 3 buckets of float64 LeNet, 0.05 MB gives 5.
CONFIGS = {
    "sync-flat": dict(overlap=False, bucket_cap_mb=None),  # the default algorithm: auto (shm here)
    "sync-3": dict(overlap=False, bucket_cap_mb=0.25),
    "sync-native-3": dict(overlap=False, allreduce="native", bucket_cap_mb=0.25),
    # overlap=True: auto would turn shm's off where the workers' threads fill the cores (2 here).
    "overlap-native-1": dict(overlap=True, bucket_cap_mb=None),
    "overlap-native-first": dict(overlap=True, bucket_cap_mb=0.5, first_bucket_cap_mb=1e-4),  # fc2.bias alone
    **{f"overlap-{a}-{n}": dict(overlap=True, allreduce=a, bucket_cap_mb=cap)
       for a in ("native", "shm", "ring", "tree") for n, cap in ((3, 0.25), (5, 0.05))},
    "overlap-naive-3": dict(overlap=True, allreduce="naive", bucket_cap_mb=0.25),
}


ACCUM_CASES = (("native", True), ("ring", True), ("shm", True), ("native", False), ("shm", False))


class WithExtraHead(nn.Module):
    """LeNet plus a head only some ranks use: its bucket (0) completes on those ranks only."""

    def __init__(self) -> None:
        super().__init__()
        self.lenet = LeNet()
        self.extra = nn.Linear(10, 10)

    def forward(self, x, use_extra: bool):
        out = self.lenet(x)
        return out + self.extra(out) if use_extra else out


def _model(kind: str = "lenet") -> nn.Module:
    torch.manual_seed(11)
    return (LeNet() if kind == "lenet" else WithExtraHead()).double()


def _data():
    gen = torch.Generator().manual_seed(7)
    return (torch.rand(GLOBAL_BATCH, 1, 28, 28, generator=gen, dtype=torch.float64),
            torch.randint(0, 10, (GLOBAL_BATCH,), generator=gen))


def _grads(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in module.parameters()]).clone()


class CountingComm:
    """Counts the gradient exchange's calls: not the replica's one-time comparison of the sizes
    shard_loss got on each rank, after the first step (tests/distributed/test_shard_loss_sizes.py),
    nor its comparison with the other replicas at the first step (guards/replicas.py)."""

    def __init__(self, comm: AsyncComm) -> None:
        self.comm, self.launched = comm, 0

    def _count(self, named: dict) -> None:
        tag = named.get("tag")
        self.launched += tag is None or tag.phase not in ("first-step check", "replica check")

    def allreduce_async(self, tensor, *, algorithm, **named):  # named: the tag (and on_done)
        self._count(named)
        return self.comm.allreduce_async(tensor, algorithm=algorithm, **named)

    def allreduce(self, tensor, *, algorithm, **named):  # the synchronous exchange (overlap=False); named: the tag
        self._count(named)
        return self.comm.allreduce(tensor, algorithm=algorithm, **named)


def _worker(world) -> dict:
    X, y = _data()
    shard = rank_shard(torch.arange(GLOBAL_BATCH), rank=world.rank, world_size=world.world_size)
    Xs, ys = X[shard], y[shard]
    out: dict = {}
    # One private group and one shm segment, shared by every replica below.
    with AsyncComm(world=world, algorithms=ALGORITHMS) as async_comm:
        def make(kind="lenet", **options):
            comm = CountingComm(async_comm)
            return DataParallel.over(comm, _model(kind), world=world, options=DataParallelConfig(**options)), comm

        for name, options in CONFIGS.items():
            dp, comm = make(**options)
            dp.zero_grad()
            (F.cross_entropy(dp(Xs), ys, reduction="sum") / GLOBAL_BATCH).backward()
            launched_in_backward = comm.launched
            dp.finish_gradient_sync()
            out[name] = (_grads(dp.module), len(dp.buckets), launched_in_backward, comm.launched)
            dp.close()

        # Rank 0 alone uses the extra head: bucket 0 never completes elsewhere.
        for algorithm in ("native", "ring", "shm"):
            dp, comm = make("extra", allreduce=algorithm, overlap=True, first_bucket_cap_mb=880 / 2**20)
            dp.zero_grad()
            (F.cross_entropy(dp(Xs, world.rank == 0), ys, reduction="sum") / GLOBAL_BATCH).backward()
            launched_in_backward = comm.launched
            dp.finish_gradient_sync()
            out[f"unused-{algorithm}"] = (_grads(dp.module), len(dp.buckets), launched_in_backward, comm.launched)
            dp.close()

        # Only the first world_size - 1 examples: the last rank's shard is empty (no backward).
        tiny = rank_shard(torch.arange(world.world_size - 1), rank=world.rank, world_size=world.world_size)
        for algorithm in ("native", "tree", "shm"):  # LeNet in 3 buckets each (native's own cap takes it whole)
            dp, comm = make(allreduce=algorithm, overlap=True, bucket_cap_mb=0.25)
            train_batch(dp, torch.optim.SGD(dp.module.parameters(), lr=0.0), X[tiny], y[tiny],
                        global_batch_size=world.world_size - 1)
            out[f"empty-{algorithm}"] = (_grads(dp.module), len(tiny), comm.launched)
            dp.close()

        for algorithm, overlap in ACCUM_CASES:
            for steps in (1, 3):
                dp, comm = make(allreduce=algorithm, overlap=overlap, bucket_cap_mb=0.25)
                train_batch(dp, torch.optim.SGD(dp.module.parameters(), lr=0.0), Xs, ys,
                            global_batch_size=GLOBAL_BATCH, grad_accum_steps=steps)
                out[f"accum-{algorithm}-{overlap}-{steps}"] = (_grads(dp.module), comm.launched)
                dp.close()

        # One send path: the same buckets launched by hooks during backward or all at the finish.
        for algorithm in ALGORITHMS:
            for overlap in (True, False):
                dp, _ = make(allreduce=algorithm, overlap=overlap, bucket_cap_mb=0.25)
                dp.zero_grad()
                (F.cross_entropy(dp(Xs), ys, reduction="sum") / GLOBAL_BATCH).backward()
                dp.finish_gradient_sync()
                out[f"buckets-{algorithm}-{overlap}"] = [b.buffer.clone() for b in dp.buckets]
                dp.close()

        # no_sync: two local backwards send nothing; the next finish sends their sum.
        for overlap in (True, False):
            dp, comm = make(overlap=overlap)
            dp.zero_grad()
            half = len(ys) // 2
            with dp.no_sync():
                for part in (slice(0, half), slice(half, None)):
                    (F.cross_entropy(dp(Xs[part]), ys[part], reduction="sum") / GLOBAL_BATCH).backward()
                dp.finish_gradient_sync()
            local = _grads(dp.module)
            launched_in_no_sync = comm.launched
            dp.finish_gradient_sync()
            out[f"no_sync-{overlap}"] = (local, launched_in_no_sync, _grads(dp.module))
            dp.close()
    return out


def _reference(indices=None, *, divisor: int = GLOBAL_BATCH, extra_for=None) -> torch.Tensor:
    """One process, one backward: gradient of (loss sum over `indices`) / divisor. With
    `extra_for` [(indices, use_extra), ...]: the extra-head model over each rank's shard."""
    X, y = _data()
    if extra_for is None:
        model = _model()
        loss = F.cross_entropy(model(X[indices]), y[indices], reduction="sum")
    else:
        model = _model("extra")
        loss = sum(F.cross_entropy(model(X[s], use), y[s], reduction="sum") for s, use in extra_for)
    (loss / divisor).backward()
    return _grads(model)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda k: f"{k}procs")
def run(request):
    world_size = request.param
    return world_size, run_workers(_worker, world_size, timeout_s=180)


def test_every_rank_holds_identical_gradients(run):
    _, results = run
    for key, value in results[0].items():
        for other in results[1:]:
            if key.startswith("no_sync"):  # the local, pre-sync gradients differ by design
                assert torch.equal(value[2], other[key][2]), key
            else:
                assert torch.equal(value[0], other[key][0]), key


def test_overlapped_buckets_match_sync_and_one_process(run):
    _, results = run
    full = _reference(torch.arange(GLOBAL_BATCH))
    mine = results[0]
    for name in CONFIGS:
        grads, num_buckets, launched_in_backward, launched = mine[name]
        torch.testing.assert_close(grads, full, **TOL, msg=lambda m, name=name: f"{name}: {m}")
        torch.testing.assert_close(grads, mine["sync-flat"][0], **TOL)
        if name.startswith("overlap"):  # every parameter used: every bucket went out in backward
            assert launched_in_backward == launched == num_buckets, name
    for name in ("sync-flat", "sync-3", "sync-native-3"):  # synchronous: each bucket once, after backward
        assert mine[name][2] == 0 and mine[name][3] == mine[name][1], name
    assert {n: mine[n][1] for n in ("sync-flat", "sync-3", "overlap-native-1", "overlap-ring-3",
                                    "overlap-tree-5", "overlap-native-first")} == {
        "sync-flat": 1, "sync-3": 3, "overlap-native-1": 1, "overlap-ring-3": 3, "overlap-tree-5": 5,
        "overlap-native-first": 4}


def test_parameter_unused_on_some_ranks(run):
    world_size, results = run
    shards = [rank_shard(torch.arange(GLOBAL_BATCH), rank=r, world_size=world_size) for r in range(world_size)]
    expected = _reference(extra_for=[(s, r == 0) for r, s in enumerate(shards)])
    for algorithm in ("native", "ring", "shm"):
        for rank, result in enumerate(results):
            grads, num_buckets, launched_in_backward, launched = result[f"unused-{algorithm}"]
            torch.testing.assert_close(grads, expected, **TOL)
            assert launched == num_buckets
            # Elsewhere bucket 0 (the extra head) never completes, so nothing may overtake it.
            assert launched_in_backward == (num_buckets if rank == 0 else 0)


def test_empty_shard_rank_still_joins(run):
    world_size, results = run
    expected = _reference(torch.arange(world_size - 1), divisor=world_size - 1)
    for algorithm in ("native", "tree", "shm"):
        assert results[-1][f"empty-{algorithm}"][1] == 0  # the last rank really had no examples
        for result in results:
            grads, _, launched = result[f"empty-{algorithm}"]
            torch.testing.assert_close(grads, expected, **TOL)
            assert launched == 3


def test_grad_accum_three_equals_one(run):
    _, results = run
    full = _reference(torch.arange(GLOBAL_BATCH))
    for algorithm, overlap in ACCUM_CASES:
        one, launched_one = results[0][f"accum-{algorithm}-{overlap}-1"]
        three, launched_three = results[0][f"accum-{algorithm}-{overlap}-3"]
        torch.testing.assert_close(three, one, **TOL)
        torch.testing.assert_close(three, full, **TOL)
        assert launched_one == launched_three == 3  # one exchange of each bucket per step


def test_no_sync_accumulates_without_communication(run):
    world_size, results = run
    full = _reference(torch.arange(GLOBAL_BATCH))
    for overlap in (True, False):
        for rank, result in enumerate(results):
            local, launched_in_no_sync, synced = result[f"no_sync-{overlap}"]
            shard = rank_shard(torch.arange(GLOBAL_BATCH), rank=rank, world_size=world_size)
            # Still this rank's own gradient (scaled by the global size): nothing was summed.
            torch.testing.assert_close(local, _reference(shard), **TOL)
            assert launched_in_no_sync == 0
            torch.testing.assert_close(synced, full, **TOL)


def test_synchronous_and_overlapped_exchanges_give_bitwise_equal_buckets(run):
    _, results = run
    for result in results:
        for algorithm in ALGORITHMS:
            overlapped, synchronous = result[f"buckets-{algorithm}-True"], result[f"buckets-{algorithm}-False"]
            assert len(overlapped) == len(synchronous) == 3, algorithm
            for index, (a, b) in enumerate(zip(overlapped, synchronous)):
                assert torch.equal(a, b), f"{algorithm}: bucket {index} differs between overlap=True and overlap=False"
