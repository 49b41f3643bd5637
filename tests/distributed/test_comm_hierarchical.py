"""The hierarchical collectives on simulated hosts in one process tree, against torch's own
`dist.all_reduce` and the exact float64 sum of every rank's known inputs.

A host here is what torchrun says it is: each worker's World gets a node rank and a local world
size of m (no namespaces are needed for correctness; tests/distributed/test_hosts_bed.py runs
real torchrun agents in network namespaces). One spawn per world size runs every layout it can
hold - hosts of contiguous ranks (torchrun's numbering) and interleaved ones - with both variants,
every dtype, sizes that stream through many rounds of a small slot, and the sharded halves with
even, uneven and one-owner counts; then the same calls through AsyncComm, async and sync.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from phalanx.comm import AsyncComm, Hierarchy, all_gather, allreduce, reduce_scatter
from phalanx.comm.counts import own_range
from phalanx.comm.hierarchical import VARIANTS
from phalanx.comm.shm import shm_supported
from tests.distributed.harness import run_workers
from tests.unit.test_comm_shards import counts_like

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(shm_supported() is not None, reason=f"no shm collectives here: {shm_supported()}")]

DTYPES = (torch.float64, torch.float32, torch.bfloat16)
NUMELS = (7, 4099, 65537)  # 65537 elements stream through 33..129 rounds of a 4 KiB slot
PATTERNS = ("even", "uneven", "owner")
SLOT_BYTES = 4096


def make_input(dtype, numel: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7919 * numel + 31 * DTYPES.index(dtype) + rank)
    return torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)


def layouts(world_size: int) -> list[tuple[int, int, str]]:
    """(hosts, workers per host, numbering) that split `world_size` ranks into >= 2 hosts."""
    out = []
    for m in range(1, world_size):
        if world_size % m == 0 and world_size // m >= 2:
            out += [(world_size // m, m, "contiguous")] + ([(world_size // m, m, "interleaved")] if m > 1 else [])
    return out


def as_host(world, hosts: int, per_host: int, numbering: str):
    """This worker's World as a rank of `hosts` simulated hosts of `per_host` workers."""
    if numbering == "contiguous":  # torchrun's: node rank n runs ranks n*m .. n*m+m-1
        node, local = divmod(world.rank, per_host)
    else:
        local, node = divmod(world.rank, hosts)
    return replace(world, node_rank=node, local_rank=local, local_world_size=per_host, board=None)


# World size -> (layouts, dtypes, sizes) its spawn runs: every layout of 4 ranks, and two of 6
# (hosts of 2 and of 3 workers) on fewer cases, since 6 workers on 2 cores take minutes.
PLANS = {4: (layouts(4), DTYPES, NUMELS),
         6: ([(3, 2, "contiguous"), (2, 3, "interleaved")], (torch.float64,), (7, 65537))}


def every_case(world) -> dict:
    """Worker: per layout, variant, dtype and size, the allreduce, reduce-scatter and all-gather
    results, and torch's sum of the same inputs."""
    results = {}
    plan_layouts, dtypes, numels = PLANS[world.world_size]
    for layout in plan_layouts:
        host_world = as_host(world, *layout)
        for variant in VARIANTS:
            hierarchy = Hierarchy(world=host_world, variant=variant, slot_bytes=SLOT_BYTES)
            assert hierarchy.layout.members == tuple(r for r in range(world.world_size)
                                                     if as_host(replace(world, rank=r), *layout).node_rank
                                                     == host_world.node_rank)
            assert hierarchy.shm is None or hierarchy.shm.members == hierarchy.layout.members  # a segment per host
            for dtype, numel in itertools.product(dtypes, numels):
                reference = make_input(dtype, numel, world.rank)
                dist.all_reduce(reference)
                flat = make_input(dtype, numel, world.rank)
                allreduce(flat, world=host_world, algorithm="hierarchical", transport=hierarchy)
                results[(layout, variant, dtype, numel, "allreduce")] = (flat, reference)
                for pattern in PATTERNS:
                    counts = counts_like(world.world_size, numel, pattern)
                    lo, hi = own_range(counts, world.rank)
                    mine = reduce_scatter(make_input(dtype, numel, world.rank), counts=counts, world=host_world,
                                          algorithm="hierarchical", transport=hierarchy)
                    gathered = torch.full((numel,), float("nan"), dtype=dtype)
                    gathered[lo:hi] = make_input(dtype, numel, world.rank)[lo:hi]
                    all_gather(gathered, counts=counts, world=host_world, algorithm="hierarchical",
                               transport=hierarchy)
                    results[(layout, variant, dtype, numel, pattern)] = (mine.clone(), reference[lo:hi], gathered)
            hierarchy.close()
        with AsyncComm(world=host_world, algorithms=("hierarchical",)) as comm:  # the default variant
            dtype, numel = torch.float64, 65537
            counts = counts_like(world.world_size, numel, "uneven")
            summed, scattered = make_input(dtype, numel, world.rank), make_input(dtype, numel, world.rank)
            handles = [comm.allreduce_async(summed, algorithm="hierarchical"),
                       comm.reduce_scatter_async(scattered, counts=counts, algorithm="hierarchical")]
            results[(layout, "async")] = (handles[0].wait().clone(), handles[1].wait().clone())
            again = comm.allreduce(make_input(dtype, numel, world.rank), algorithm="hierarchical")
            results[(layout, "sync")] = again
    return results


def exact(dtype, numel: int, world_size: int) -> torch.Tensor:
    return sum(make_input(dtype, numel, r).double() for r in range(world_size))


def bound(dtype, numel: int, world_size: int) -> torch.Tensor:
    """Worst-case rounding of a k-term sum in any order, (k-1) eps sum|x_i| (Higham 2002, 4.2)."""
    eps = torch.finfo(dtype).eps
    return (world_size - 1) * eps * sum(make_input(dtype, numel, r).double().abs() for r in range(world_size)) \
        + torch.finfo(dtype).tiny


@pytest.mark.parametrize("world_size", [4, 6])
def test_hierarchical_collectives_match_torch_and_are_bitwise_equal_on_every_rank(world_size):
    results = run_workers(every_case, world_size, timeout_s=300)
    plan_layouts, dtypes, numels = PLANS[world_size]
    for layout, variant, dtype, numel in itertools.product(plan_layouts, VARIANTS, dtypes, numels):
        where = f"{layout} {variant} {dtype} n={numel}"
        want, limit = exact(dtype, numel, world_size), bound(dtype, numel, world_size)
        first, _ = results[0][(layout, variant, dtype, numel, "allreduce")]
        for rank in range(world_size):
            out, reference = results[rank][(layout, variant, dtype, numel, "allreduce")]
            assert torch.equal(out, first), f"allreduce {where}: rank {rank} differs from rank 0"
            assert bool(((out.double() - want).abs() <= limit).all()), f"allreduce {where}: off the exact sum"
            if dtype != torch.bfloat16:
                torch.testing.assert_close(out, reference, msg=lambda m: f"allreduce {where}: {m}")
        for pattern in PATTERNS:
            counts = counts_like(world_size, numel, pattern)
            pieces = torch.cat([make_input(dtype, numel, r)[slice(*own_range(counts, r))] for r in range(world_size)])
            for rank in range(world_size):
                mine, reference, gathered = results[rank][(layout, variant, dtype, numel, pattern)]
                lo, hi = own_range(counts, rank)
                assert mine.shape == (hi - lo,), f"reduce-scatter {where} {pattern}"
                assert bool(((mine.double() - want[lo:hi]).abs() <= limit[lo:hi]).all()), \
                    f"reduce-scatter {where} {pattern} rank {rank}: off the exact sum"
                if dtype != torch.bfloat16:
                    torch.testing.assert_close(mine, reference, msg=lambda m: f"reduce-scatter {where}: {m}")
                assert torch.equal(gathered, pieces), f"all-gather {where} {pattern} rank {rank}"
    for layout in plan_layouts:
        for rank in range(world_size):
            summed, scattered = results[rank][(layout, "async")]
            assert torch.equal(summed, results[0][(layout, "async")][0]), f"async allreduce {layout} rank {rank}"
            if layout[0] == 2:  # two hosts' sums commute: the slot size (window) cannot change a bit
                assert torch.equal(summed, results[rank][(layout, "slices", torch.float64, 65537, "allreduce")][0]), \
                    f"async allreduce {layout} rank {rank}"
            assert torch.equal(results[rank][(layout, "sync")], summed), f"sync allreduce {layout} rank {rank}"
            counts = counts_like(world_size, 65537, "uneven")
            lo, hi = own_range(counts, rank)
            assert torch.equal(scattered, results[rank][(layout, "slices", torch.float64, 65537, "uneven")][0]), \
                f"async reduce-scatter {layout} rank {rank}"
            assert scattered.shape == (hi - lo,)
