"""Reduce-scatter and all-gather on 2, 3 and 4 gloo processes, for shm, ring and native, against
torch's own `dist.all_reduce` and the exact float64 sum of every rank's known inputs.

One spawn per world size (start-up dominates). The worker runs every dtype x size x counts
pattern (even, uneven with empty ranks, one owner of everything; sizes up to 16 times the small
shm slot it opens, so tensors stream through many rounds) through the module-level functions,
checks all-gather bitwise against the pieces every rank started with, runs each reduce-scatter
twice (same inputs, same bits), then mixes reduce-scatter, allreduce and all-gather in one order
on one AsyncComm, async and sync. The parent checks the sums against the bounds and torch.
"""

from __future__ import annotations

import itertools
import threading

import pytest
import torch
import torch.distributed as dist

from phalanx.comm import AsyncComm, CollectiveMismatch, ShmGroup, all_gather, all_reduce_sum_, allreduce, reduce_scatter
from phalanx.comm.async_ops import COMM_THREAD
from phalanx.comm.counts import own_range
from phalanx.comm.shm import shm_supported
from tests.distributed.harness import run_workers
from tests.unit.test_comm_shards import counts_like

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(shm_supported() is not None, reason=f"no shm collectives here: {shm_supported()}")]

DTYPES = (torch.float32, torch.float64, torch.bfloat16)
NUMELS = (0, 7, 4099, 65537)  # 65537 bf16..float64 stream through 33..129 rounds of a 4 KiB slot
PATTERNS = ("even", "uneven", "owner")
ALGORITHMS = ("native", "shm", "ring")
CASES = [c for c in itertools.product(DTYPES, NUMELS, PATTERNS) if c[1] or c[2] == "even"]
ASYNC_CASES = [(torch.float64, 4099, "uneven"), (torch.bfloat16, 65537, "owner"), (torch.float32, 7, "even")]


def make_input(case, rank: int) -> torch.Tensor:
    dtype, numel, pattern = case
    seed = 100 * DTYPES.index(dtype) + 10 * NUMELS.index(numel) + PATTERNS.index(pattern)  # the same in every process
    gen = torch.Generator().manual_seed(seed + 1000 * rank)
    return torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)


def pieces(case, world_size: int) -> torch.Tensor:
    """What all-gather must leave everywhere: rank r's own range of rank r's input, for every r."""
    counts = counts_like(world_size, case[1], case[2])
    return torch.cat([make_input(case, r)[slice(*own_range(counts, r))] for r in range(world_size)])


def _gathered(case, world, algorithm: str, gather) -> torch.Tensor:
    counts = counts_like(world.world_size, case[1], case[2])
    flat = torch.full((case[1],), float("nan"), dtype=case[0])  # everything outside its range is overwritten
    lo, hi = own_range(counts, world.rank)
    flat[lo:hi] = make_input(case, world.rank)[lo:hi]
    out = gather(flat, counts, algorithm)
    assert out is flat and torch.equal(flat, pieces(case, world.world_size)), f"all-gather {algorithm} {case}"
    return flat


def shards_every_case(world) -> dict:
    """Worker: per case torch's sum of this rank's range and each algorithm's reduce-scatter of it."""
    results, k = {}, world.world_size
    group = ShmGroup(world=world, slot_bytes=4096)  # small: every size but 7 streams through rounds
    for case in CASES:
        counts = counts_like(k, case[1], case[2])
        lo, hi = own_range(counts, world.rank)
        reference = make_input(case, world.rank)
        dist.all_reduce(reference)
        per_algorithm = {"reference": reference[lo:hi].clone()}
        summed = allreduce(make_input(case, world.rank), world=world, algorithm="shm", transport=group)
        for algorithm in ALGORITHMS:
            transport = group if algorithm == "shm" else None
            runs = []
            for _ in range(2):
                flat = make_input(case, world.rank)
                view = reduce_scatter(flat, counts=counts, world=world, algorithm=algorithm, transport=transport)
                assert view.data_ptr() == flat[lo:hi].data_ptr() and view.numel() == hi - lo, (algorithm, case)
                runs.append(view.clone())
            assert torch.equal(runs[0], runs[1]), f"reduce-scatter {algorithm} {case}: not the same bits twice"
            if algorithm == "shm":  # the same sums in the same order as its allreduce
                assert torch.equal(runs[0], summed[lo:hi]), f"reduce-scatter shm {case}: not its allreduce's bits"
            per_algorithm[algorithm] = runs[0]
            _gathered(case, world, algorithm, lambda f, c, a: all_gather(f, counts=c, world=world, algorithm=a,
                                                                         transport=group if a == "shm" else None))
        results[case] = per_algorithm
    group.close()

    # One comm, one order: reduce-scatter, allreduce, all-gather, all three in flight at once for
    # every algorithm (shm and ring queue on the comm's thread, native on the default group, a
    # main-thread collective in between); then the same calls synchronously. Same bits as above.
    # Then again on a comm without a thread (threaded=False: every launch but native's runs at once).
    for threaded in (True, False):
        _one_order(world, results, threaded)
    return results


def _one_order(world, results: dict, threaded: bool) -> None:
    k, mode = world.world_size, "" if threaded else "no thread, "
    with AsyncComm(world=world, algorithms=ALGORITHMS, threaded=threaded) as comm:
        for case in ASYNC_CASES:
            counts = counts_like(k, case[1], case[2])
            for algorithm in ALGORITHMS:
                scattered, summed = make_input(case, world.rank), make_input(case, world.rank)
                handles = [comm.reduce_scatter_async(scattered, counts=counts, algorithm=algorithm),
                           comm.allreduce_async(summed, algorithm=algorithm)]
                gathered = _gathered(case, world, algorithm, lambda f, c, a: comm.all_gather_async(
                    f, counts=c, algorithm=a).wait())
                all_reduce_sum_(torch.ones(3), world=world)
                results[(mode + "async", case, algorithm)] = (handles[0].wait().clone(), handles[1].wait().clone())
                scattered, summed = make_input(case, world.rank), make_input(case, world.rank)
                sync = comm.reduce_scatter(scattered, counts=counts, algorithm=algorithm).clone()
                comm.allreduce(summed, algorithm=algorithm)
                _gathered(case, world, algorithm, lambda f, c, a: comm.all_gather(f, counts=c, algorithm=a))
                results[(mode + "sync", case, algorithm)] = (sync, summed)
                results[(mode + "allreduce", case, algorithm)] = allreduce(
                    make_input(case, world.rank), world=world, algorithm=algorithm,
                    transport=comm.shm if algorithm == "shm" else None)
                assert gathered.numel() == case[1]
        threads = [t.name for t in threading.enumerate() if t.name.startswith(COMM_THREAD)]
        assert len(threads) == threaded, threads  # the executor's one thread, once it was given work


def bound(case, world_size: int, lo: int, hi: int) -> torch.Tensor:
    """Worst-case rounding of a k-term sum in any order, (k-1) eps sum|x_i| (Higham 2002, 4.2)."""
    eps = torch.finfo(case[0]).eps
    return (world_size - 1) * eps * sum(make_input(case, r)[lo:hi].double().abs() for r in range(world_size)) \
        + torch.finfo(case[0]).tiny


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_reduce_scatter_and_all_gather_match_torch_and_the_exact_sum(world_size):
    results = run_workers(shards_every_case, world_size, timeout_s=120)
    for case in CASES:
        counts = counts_like(world_size, case[1], case[2])
        for rank in range(world_size):
            lo, hi = own_range(counts, rank)
            exact = sum(make_input(case, r)[lo:hi].double() for r in range(world_size))
            limit = bound(case, world_size, lo, hi)
            reference = results[rank][case]["reference"]
            for algorithm in ALGORITHMS:
                out, where = results[rank][case][algorithm], f"{algorithm} {case} rank {rank} counts {counts}"
                assert out.dtype == case[0] and out.shape == (hi - lo,), where
                assert bool(((out.double() - exact).abs() <= limit).all()), f"{where}: off the exact sum"
                if case[0] == torch.bfloat16:
                    assert bool(((out.double() - reference.double()).abs() <= 2 * limit).all()), where
                else:
                    torch.testing.assert_close(out, reference, msg=lambda m: f"{where}: {m}")
    for rank, case, algorithm, mode in itertools.product(range(world_size), ASYNC_CASES, ALGORITHMS,
                                                         ("", "no thread, ")):
        sync_scattered, sync_summed = results[rank][(mode + "sync", case, algorithm)]
        async_scattered, async_summed = results[rank][(mode + "async", case, algorithm)]
        where = f"{mode}{algorithm} {case} rank {rank}"
        assert torch.equal(async_scattered, results[rank][case][algorithm]), f"async reduce-scatter {where}"
        assert torch.equal(sync_scattered, results[rank][case][algorithm]), f"sync reduce-scatter {where}"
        plain = results[rank][(mode + "allreduce", case, algorithm)]
        assert torch.equal(async_summed, plain) and torch.equal(sync_summed, plain), f"allreduce between, {where}"
        assert torch.equal(plain, results[0][("allreduce", case, algorithm)]), f"allreduce differs from rank 0, {where}"


def _kinds_mismatched(world) -> dict:
    """Rank 0 reduce-scatters, then all-gathers, while rank 1 allreduces the same bytes (shm
    completes both rounds): what each rank's error says."""
    out = {}
    with AsyncComm(world=world, algorithms=("shm",)) as comm:
        calls = [(lambda: comm.reduce_scatter(torch.ones(8), counts=[4, 4], algorithm="shm"),
                  lambda: comm.allreduce(torch.ones(8), algorithm="shm")),
                 (lambda: comm.all_gather_async(torch.ones(8), counts=[0, 8], algorithm="shm").wait(),
                  lambda: comm.allreduce_async(torch.ones(8), algorithm="shm").wait())]
        for name, pair in zip(("reduce-scatter", "all-gather"), calls):
            try:
                pair[world.rank]()
                out[name] = "no error"
            except CollectiveMismatch as exc:
                out[name] = str(exc)
    return out


def test_a_reduce_scatter_against_a_peers_allreduce_of_one_size_is_named():
    results = run_workers(_kinds_mismatched, 2, timeout_s=60)
    for name in ("reduce-scatter", "all-gather"):
        assert results[0][name].startswith(f"ranks are in different collectives: rank 1 is in allreduce (32 B); "
                                           f"rank 0 in {name} (32 B)"), results[0][name]
        assert results[1][name].startswith(f"ranks are in different collectives: rank 0 is in {name} (32 B); "
                                           f"rank 1 in allreduce (32 B)"), results[1][name]


def _on_a_gloo_without_reduce_scatter(world) -> list[torch.Tensor]:
    """gloo refusing reduce_scatter, as torch before 2.8 does: native's reduce-scatter on gloo is
    one allreduce (its own is one allreduce per rank, slower; shards.py's docstring)."""

    def refused(*args, **kwargs):
        raise RuntimeError("ProcessGroupGloo does not support reduce_scatter")

    dist.reduce_scatter = refused
    out = []
    for case in [(torch.float64, 4099, "uneven"), (torch.float32, 7, "owner")]:
        counts = counts_like(world.world_size, case[1], case[2])
        lo, hi = own_range(counts, world.rank)
        reference = make_input(case, world.rank)
        dist.all_reduce(reference)
        view = reduce_scatter(make_input(case, world.rank), counts=counts, world=world, algorithm="native")
        out.append(torch.equal(view, reference[lo:hi]))
    return out


def test_native_reduce_scatter_on_a_gloo_without_one_is_the_allreduces_range():
    """pyproject accepts torch >= 2.4; gloo's reduce_scatter came in 2.8, and ZeRO on 2.4.1 failed."""
    assert run_workers(_on_a_gloo_without_reduce_scatter, 3, timeout_s=60) == [[True, True]] * 3
