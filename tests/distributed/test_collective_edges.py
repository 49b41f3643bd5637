"""The edges of the user-facing collectives an outside review compared with torch.distributed, on 2
gloo processes: `phalanx.reduce` sums integers exactly (2**53 + 1 survives, where a float64 sum
rounds it) and refuses complex values rather than dropping their imaginary part; every
`phalanx.allreduce` algorithm, the compiled shm kernel too, counts as an in-place write for
autograd, so a backward through a tensor it summed is refused alike whichever algorithm ran;
ranks that name different broadcast sources are one mismatch line at once (not a wait to the
timeout); two sizes that round alike are told apart in bytes."""

from __future__ import annotations

import time

import pytest
import torch

import phalanx
from phalanx.comm import ShmGroup
from tests.distributed.harness import WorkersFailed, run_workers

pytestmark = pytest.mark.distributed

ALGORITHMS = ("native", "ring", "tree", "naive", "shm")


def _refused_backward(world, algorithm: str, transport) -> str:
    """The error of a backward through a tensor `algorithm` summed after the forward saved it."""
    leaf = torch.arange(1.0, 4.0, requires_grad=True)
    summed = leaf * 2
    loss = (summed * summed).sum()  # saves `summed` for the backward
    phalanx.allreduce(summed, world=world, algorithm=algorithm, transport=transport)
    try:
        loss.backward()
    except RuntimeError as exc:
        return str(exc)
    return "backward ran on the summed values"


def _worker(world) -> dict:
    out: dict = {}
    big = 2 ** 53 + 1
    out["int sum"] = phalanx.reduce(torch.tensor(big if world.rank == 0 else 2), op="sum", world=world)
    out["python int sum"] = phalanx.reduce(big if world.rank == 0 else 2, op="sum", world=world)
    out["count mean"] = phalanx.reduce(torch.tensor(world.rank + 2), world=world)  # (2 + 3) / 2
    out["float sum"] = phalanx.reduce(torch.tensor(0.25 + world.rank), op="sum", world=world)
    try:
        phalanx.reduce(torch.tensor([1 + 2j]), op="sum", world=world)
    except ValueError as exc:
        out["complex"] = str(exc)
    with ShmGroup(world=world) as shm:
        for algorithm in ALGORITHMS:
            out[f"backward after {algorithm}"] = _refused_backward(world, algorithm, shm if algorithm == "shm" else None)
        # Two sizes that round to the same "7.6 MiB": the line must tell them apart. (Over gloo the
        # later rank compares the sizes before it sends, calls.enter: test_collective_dtypes.py.)
        try:
            phalanx.allreduce(torch.zeros(2_000_000 + 1_000 * world.rank), world=world, algorithm="shm", transport=shm)
        except Exception as exc:  # noqa: BLE001 - what the user sees
            out["sizes"] = str(exc)
    return out


def _broadcast_from_self(world) -> None:
    """Every rank names itself as the source: a mismatch, seen at the first poll of the wait."""
    phalanx.broadcast("mine", src=world.rank, world=world)


def test_reduce_autograd_and_sizes_on_two_ranks():
    for rank, out in enumerate(run_workers(_worker, 2, timeout_s=120)):
        assert out["int sum"] == out["python int sum"] == 2 ** 53 + 3 and isinstance(out["int sum"], int)
        assert out["count mean"] == 2.5 and out["float sum"] == 1.5
        assert out["complex"].startswith("reduce takes real values, got a complex tensor")
        for algorithm in ALGORITHMS:
            assert "modified by an inplace operation" in out[f"backward after {algorithm}"], (rank, algorithm)
        assert "different collectives" in out["sizes"], out["sizes"]
        assert "8,000,000 B" in out["sizes"] and "8,004,000 B" in out["sizes"], out["sizes"]


def test_ranks_that_disagree_on_a_broadcast_source_are_named_at_once():
    started = time.monotonic()
    with pytest.raises(WorkersFailed) as failed:
        run_workers(_broadcast_from_self, 2, timeout_s=60)
    text = str(failed.value)
    assert "different collectives" in text and "broadcast from rank 0" in text and "broadcast from rank 1" in text, text
    assert time.monotonic() - started < 20  # the world's collective timeout is 30 s
