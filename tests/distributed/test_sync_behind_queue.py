"""A synchronous collective made while the communication thread still has jobs runs behind them.

AsyncComm runs its hand-written algorithms' launches on one thread and its synchronous calls on
the caller's thread. Both on one shared segment (or one private group) at once mix their sums:
CI saw a DCGAN loop's discriminator, whose last backward (the generator's loss through it) left
buckets in flight, closed with a replica check whose fingerprints came back as garbage - "replicas
diverged ... by up to 0 (in 0 of 4 tensors)". On 2 gloo processes:

- the thread held by a gate, an allreduce launched behind it, then a synchronous allreduce: the
  synchronous one ends after the launched one (it ran first, concurrently, before the fix), and
  both sums are right, for shm and ring;
- a replica closed with overlapped buckets still in flight: close()'s checks pass, 8 times out
  of 8 (before the fix one of them compared garbage here).
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import phalanx
from phalanx.comm import AsyncComm
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed


def _ordered(world, algorithm: str) -> tuple[list[str], list[float], list[float]]:
    order: list[str] = []
    with AsyncComm(world=world, algorithms=(algorithm,)) as comm:
        gate = threading.Event()
        comm._executor.submit(gate.wait, 20)  # holds the thread, as a long bucket's sum would
        launched = torch.full((1000,), float(world.rank + 1), dtype=torch.float64)
        handle = comm.allreduce_async(launched, algorithm=algorithm, on_done=lambda: order.append("launched"))
        threading.Timer(0.3, gate.set).start()
        now = torch.full((10,), 10.0 * (world.rank + 1), dtype=torch.float64)
        comm.allreduce(now, algorithm=algorithm)
        order.append("synchronous")
        handle.wait()
    return order, launched.unique().tolist(), now.unique().tolist()


def _closed_in_flight(world) -> list[str]:
    said = []
    for trial in range(8):
        torch.manual_seed(trial)
        model = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 1)).double()
        try:
            options = phalanx.DataParallelConfig(overlap=True, allreduce="shm", bucket_cap_mb=0.25)
            with phalanx.DataParallel(model, world=world, options=options) as dp:
                optimizer = torch.optim.Adam(dp.parameters(), lr=0.01)
                X = torch.randn(8, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(world.rank))
                phalanx.shard_loss(dp(X).sum(), 16).backward()
                dp.finish_gradient_sync()
                optimizer.step()
                dp.zero_grad()
                phalanx.shard_loss(dp(X).sum(), 16).backward()  # its buckets launched, never finished
                assert dp.exchange_in_flight
            said.append("ok")
        except phalanx.RunFailed as error:
            said.append(str(error))
            break
    return said


def _worker(world) -> dict:
    return {"ordered": {a: _ordered(world, a) for a in ("shm", "ring")}, "closed": _closed_in_flight(world)}


@pytest.fixture(scope="module")
def results():
    return run_workers(_worker, 2, timeout_s=180)


@pytest.mark.parametrize("algorithm", ["shm", "ring"])
def test_a_synchronous_call_waits_for_the_jobs_queued_before_it(results, algorithm):
    for rank in results:
        order, launched, now = rank["ordered"][algorithm]
        assert order == ["launched", "synchronous"]
        assert (launched, now) == ([3.0], [30.0])


def test_a_replica_closed_with_buckets_in_flight_compares_true_fingerprints(results):
    for rank in results:
        assert rank["closed"] == ["ok"] * 8
