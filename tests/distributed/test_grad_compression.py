"""--grad-dtype: buckets exchanged as bf16 / fp16 give the sum of the ranks' rounded gradients.

On 2 gloo processes every element of the sum is one addition of two rounded values, so the
result is fully determined: round(round(g0) + round(g1)) in the wire dtype, widened back. The
parent computes that from each rank's local gradient and demands bitwise equality, for native
and ring, overlapped and synchronous; it also bounds the error against the float32 sum (what
compression costs) and checks the trace counts half the bytes on the wire.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from phalanx.data import rank_shard
from phalanx.models import LeNet
from phalanx.data_parallel import GRAD_DTYPES, DataParallel, DataParallelConfig, prepare
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

BATCH = 24
CASES = [(name, algorithm, overlap) for name in GRAD_DTYPES for algorithm in ("native", "ring")
         for overlap in (True, False)]


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return LeNet()


def _data():
    gen = torch.Generator().manual_seed(5)
    return torch.rand(BATCH, 1, 28, 28, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen)


def _local_grad(rank: int, world_size: int) -> torch.Tensor:
    X, y = _data()
    shard = rank_shard(torch.arange(BATCH), rank=rank, world_size=world_size)
    model = _model()
    (F.cross_entropy(model(X[shard]), y[shard], reduction="sum") / BATCH).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


class WireBytes:
    """A tracer stand-in that adds up the bytes each bucket's allreduce puts on the wire."""

    def __init__(self) -> None:
        self.nbytes = 0

    def comm_launched(self, bucket: int, nbytes: int, kind: str = "allreduce") -> None:
        self.nbytes += nbytes

    def comm_done(self, record) -> None:
        pass


def _worker(world) -> dict:
    X, y = _data()
    shard = rank_shard(torch.arange(BATCH), rank=world.rank, world_size=world.world_size)
    out = {"local": _local_grad(world.rank, world.world_size)}  # same threads as the exchange's
    for name, algorithm, overlap in CASES:
        dp = DataParallel(_model(), world=world, options=DataParallelConfig(allreduce=algorithm, overlap=overlap,
                                                                           grad_dtype=name))
        dp.tracer = WireBytes()
        try:
            dp.zero_grad()
            (F.cross_entropy(dp(X[shard]), y[shard], reduction="sum") / BATCH).backward()
            dp.finish_gradient_sync()
            grads = torch.cat([p.grad.reshape(-1) for p in dp.module.parameters()]).clone()
            sent_bytes = sum(b.storage.numel() * b.storage.element_size() for b in dp.buckets)  # flags too
            out[(name, algorithm, overlap)] = (grads, sent_bytes,
                                              [p.grad.dtype for p in dp.module.parameters()][0], dp.tracer.nbytes)
        finally:
            dp.close()
    return out


@pytest.fixture(scope="module")
def results():
    return run_workers(_worker, 2, timeout_s=90)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_sum_of_rounded_gradients_bitwise(results, case):
    name, _, _ = case
    dtype = GRAD_DTYPES[name]
    g0, g1 = results[0]["local"], results[1]["local"]
    expected = (g0.to(dtype) + g1.to(dtype)).float()
    for rank in (0, 1):
        grads, _, grad_dtype, _ = results[rank][case]
        assert grad_dtype == torch.float32  # the replica's gradients keep their dtype
        assert torch.equal(grads, expected), f"rank {rank}: max diff {(grads - expected).abs().max()}"
    assert torch.equal(results[0][case][0], results[1][case][0])  # replicas agree bitwise
    _, bucket_bytes, _, wire_bytes = results[0][case]
    assert wire_bytes * 2 == bucket_bytes  # half the bytes of float32 on the wire (the usage flags too)


@pytest.mark.parametrize("name,bound", [("bf16", 1e-2), ("fp16", 2e-3)])
def test_compression_error_is_bounded(results, name, bound):
    exact = results[0]["local"] + results[1]["local"]
    grads = results[0][(name, "native", True)][0]
    rel = ((grads - exact).abs().max() / exact.abs().max()).item()
    assert 0 < rel < bound  # nonzero: the exchange really was rounded


def test_unknown_grad_dtype_is_refused():
    with pytest.raises(ValueError, match="grad_dtype"):
        prepare(_model(), world=None, grad_dtype=torch.int8)  # refused before the world is touched
