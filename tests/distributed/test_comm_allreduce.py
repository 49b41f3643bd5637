"""Every allreduce algorithm on 2, 3 and 4 gloo processes agrees with `dist.all_reduce` and with
the exact sum, and leaves all ranks bitwise identical.

One spawn per world size (start-up dominates): the worker loops over all algorithms x sizes x
dtypes (plus a non-contiguous 2-D view and a 0-d tensor) and returns the results; the parent
compares them.
"""

from __future__ import annotations

import itertools
import shutil
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from phalanx.comm import ALGORITHMS, AsyncComm, Hierarchy, ShmGroup, all_reduce_sum_, allreduce, broadcast_
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

SIZES = (0, 1, 2, 3, 7, 13, 1000, 4099, 65537)
FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


@dataclass(frozen=True)
class Case:
    """One input per rank, deterministic in (seed, rank); `strided_view` makes it non-contiguous."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    seed: int
    strided_view: bool = False  # keep every other column of a 2-D tensor

    def base(self, rank: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1000 * self.seed + rank)
        if self.dtype == torch.int64:
            return torch.randint(-1000, 1000, self.shape, generator=gen)
        return torch.randn(self.shape, generator=gen, dtype=torch.float64).to(self.dtype)

    def view(self, base: torch.Tensor) -> torch.Tensor:
        return base[:, ::2] if self.strided_view else base

    def make(self, rank: int) -> torch.Tensor:
        return self.view(self.base(rank))


STRIDED = Case("float32-13x22[:, ::2]", (13, 22), torch.float32, seed=102, strided_view=True)
CASES = [
    Case(f"{str(dtype).removeprefix('torch.')}-{numel}", (numel,), dtype, seed=seed)
    for seed, (dtype, numel) in enumerate(itertools.product(FLOAT_DTYPES, SIZES))
] + [
    Case("int64-13", (13,), torch.int64, seed=100),
    Case("int64-4099", (4099,), torch.int64, seed=101),
    STRIDED,
    Case("float64-0d", (), torch.float64, seed=103),
]

ASYNC_CASES = [c for c in CASES if c.name in ("float64-4099", "bfloat16-7", "float32-13x22[:, ::2]")]


# shm twice over: with small slots (65537 float64s stream through 128 rounds, each summed whole
# by every rank) and with the chunked large-piece path forced for every size (1, 2, 3 elements
# on 4 ranks leave chunks empty; 65537 float64s take 8 rounds of a 64 KB slot); each with its
# rounds compiled (where the host has a C compiler) and in Python, which must give the same bits.
SHM_VARIANTS = {"shm": dict(slot_bytes=4096), "shm-chunked": dict(slot_bytes=64 << 10, small_bytes=0)}
SHM_VARIANTS |= {f"{name}-python": dict(options, compiled=False) for name, options in SHM_VARIANTS.items()}
NAMES = (*ALGORITHMS, "shm-chunked", "shm-python", "shm-chunked-python")


def allreduce_every_case(world) -> dict:
    """Worker: for each case, the native reference and each algorithm's result on this rank."""
    results = {}
    groups = {name: ShmGroup(world=world, **options) for name, options in SHM_VARIANTS.items()}
    # hierarchical on one host: its shm reduce-scatter and all-gather (several hosts:
    # test_comm_hierarchical.py, test_hosts_bed.py).
    groups["hierarchical"] = Hierarchy(world=world, slot_bytes=4096)
    for case in CASES:
        reference = case.make(world.rank).contiguous()
        dist.all_reduce(reference)
        per_algorithm = {"reference": reference}
        for algorithm in NAMES:
            base = case.base(world.rank)
            tensor = case.view(base)
            stride = tensor.stride()
            transport = groups.get(algorithm)
            returned = allreduce(tensor, world=world, algorithm=algorithm.removesuffix("-python").removesuffix("-chunked"),
                                 transport=transport)
            assert returned is tensor and tensor.stride() == stride, f"{algorithm} {case.name}: not in place"
            if case.strided_view:  # the skipped columns of the base tensor stay untouched
                assert torch.equal(base[:, 1::2], case.base(world.rank)[:, 1::2]), f"{algorithm} wrote outside the view"
            per_algorithm[algorithm] = tensor.clone()
        results[case.name] = per_algorithm
    results["shm rounds"] = groups["shm"].rounds
    for group in groups.values():
        group.close()

    # The native conveniences, on a non-contiguous tensor, from the last rank.
    tensor = STRIDED.make(world.rank)
    src = world.world_size - 1
    assert broadcast_(tensor, world=world, src=src) is tensor
    results["broadcast"] = tensor.clone()
    results["all_reduce_sum"] = all_reduce_sum_(torch.tensor([world.rank + 1.0]), world=world)

    # Async: every algorithm on several cases in flight at once (p2p ones queue on the comm
    # thread's own group) while the main thread runs a native collective in between.
    with AsyncComm(world=world, algorithms=ALGORITHMS) as comm:
        launched = []
        for case in ASYNC_CASES:
            for algorithm in ALGORITHMS:
                tensor = case.make(world.rank)
                launched.append((case.name, algorithm, tensor, comm.allreduce_async(tensor, algorithm=algorithm)))
        all_reduce_sum_(torch.ones(3), world=world)
        for case_name, algorithm, tensor, handle in launched:
            assert handle.wait() is tensor and handle.waited
            results[f"async {case_name} {algorithm}"] = tensor.clone()
    return results


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if tensor.dim() else _bits(tensor.view(1))


def error_bound(case: Case, world_size: int) -> torch.Tensor:
    """Worst-case rounding error of summing k values in any order: (k-1) * eps * sum|x_i|.

    The standard bound for recursive summation (Higham, "Accuracy and Stability of Numerical
    Algorithms", 2nd ed., section 4.2), with eps (twice the unit roundoff) for slack.
    """
    eps = torch.finfo(case.dtype).eps
    abs_sum = sum(case.make(rank).double().abs() for rank in range(world_size))
    return (world_size - 1) * eps * abs_sum + torch.finfo(case.dtype).tiny


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_allreduce_algorithms_match_native_and_exact_sum(world_size):
    results = run_workers(allreduce_every_case, world_size, timeout_s=90)

    for case in CASES:
        exact = sum(case.make(rank).double() for rank in range(world_size))
        bound = error_bound(case, world_size) if case.dtype.is_floating_point else None
        for name in ("reference", *NAMES):
            outputs = [results[rank][case.name][name] for rank in range(world_size)]
            for rank, out in enumerate(outputs):
                where = f"{name}, {case.name}, rank {rank}"
                assert out.dtype == case.dtype and out.shape == exact.shape, where
                assert torch.equal(out, outputs[0]), f"{where}: differs from rank 0 (replicas would drift)"
            out = outputs[0]
            if case.dtype == torch.int64:
                assert torch.equal(out, exact.to(torch.int64)), f"{name}, {case.name}"
                continue
            # Within the rounding bound of the exact sum, hence within twice it of native's result.
            assert bool(((out.double() - exact).abs() <= bound).all()), f"{name}, {case.name}: off the exact sum"
            if case.dtype == torch.bfloat16:
                reference = results[0][case.name]["reference"].double()
                assert bool(((out.double() - reference).abs() <= 2 * bound).all()), f"{name}, {case.name}"
            else:
                torch.testing.assert_close(out, results[0][case.name]["reference"], msg=lambda m: f"{name}: {m}")

    for case in CASES:  # compiled rounds add in the same order as Python's: the same bits, zeros' signs too
        for name in ("shm", "shm-chunked"):
            compiled, python = results[0][case.name][name], results[0][case.name][f"{name}-python"]
            assert _bits(compiled) == _bits(python), f"{name} {case.name}: compiled rounds differ from Python's"
    if shutil.which("cc") is not None:
        assert results[0]["shm rounds"] == "compiled", results[0]["shm rounds"]

    src = world_size - 1
    for rank in range(world_size):
        assert torch.equal(results[rank]["broadcast"], STRIDED.make(src))
        assert results[rank]["all_reduce_sum"].item() == world_size * (world_size + 1) / 2
        for case in ASYNC_CASES:  # same algorithm, same inputs: the same bits as the blocking call
            for algorithm in ALGORITHMS:
                async_result = results[rank][f"async {case.name} {algorithm}"]
                assert torch.equal(async_result, results[rank][case.name][algorithm]), f"async {algorithm} {case.name}"
