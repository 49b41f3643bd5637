"""The NaN/Inf check's notes taken by the shm allreduce as it moves the data (ShmGroup.allreduce's
`notes`: this rank's sum on entry, the summed tensor's sum): the same result bits as without them,
sums that match torch's, and a NaN or Inf on one rank seen in that rank's own note and in every
rank's summed one - through the compiled rounds and the Python ones, a round summed whole, rounds
in chunks (three ranks, large pieces) and a tensor that streams through many rounds.

In the distributed tier: building the kernel runs the C compiler, and the rounds need a group.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from phalanx.comm import shm_kernel
from phalanx.comm.shm import ShmGroup, shm_supported
from tests.distributed.harness import run_workers

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(shm_supported() is not None, reason=f"no shm allreduce here: {shm_supported()}")]
needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the rounds run in Python here")


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_compiled_noted_copy_and_sum_move_the_same_bits_and_note_the_sum(dtype):
    library, reason = shm_kernel.load()
    assert library is not None, reason
    g = torch.Generator().manual_seed(3)
    for k in (2, 3, 5):
        for n in (1, 31, 32, 33, 1000, 4099):  # about the kernel's 32 lanes
            stride = n + 7
            rows = torch.randn(k * stride, generator=g, dtype=torch.float64).to(dtype)
            rows[stride] = -0.0
            view = rows.as_strided((k, n), (stride, 1))
            plain, noted = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
            library.phx_sum_rows(plain.data_ptr(), rows.data_ptr(), stride * rows.element_size(), k, n,
                                 shm_kernel.DTYPES[dtype])
            note = torch.full((1,), 2.0, dtype=torch.float64)  # added to, not overwritten
            library.phx_sum_rows_noted(noted.data_ptr(), rows.data_ptr(), stride * rows.element_size(), k, n,
                                       shm_kernel.DTYPES[dtype], note.data_ptr())
            assert _bits(noted) == _bits(plain), f"k={k} n={n}"
            assert math.isclose(note.item() - 2.0, plain.double().sum().item(), rel_tol=1e-4, abs_tol=1e-3)
            copied, copy_note = torch.empty(n, dtype=dtype), torch.zeros(1, dtype=torch.float64)
            library.phx_copy_noted(copied.data_ptr(), view[1].contiguous().data_ptr(), n, shm_kernel.DTYPES[dtype],
                                   copy_note.data_ptr())
            assert _bits(copied) == _bits(view[1]), f"k={k} n={n}"
            assert math.isclose(copy_note.item(), view[1].double().sum().item(), rel_tol=1e-4, abs_tol=1e-3)
            for bad in (float("nan"), float("inf")):
                spoilt = view[1].contiguous()
                spoilt[n // 2] = bad
                copy_note.zero_()
                library.phx_copy_noted(copied.data_ptr(), spoilt.data_ptr(), n, shm_kernel.DTYPES[dtype],
                                       copy_note.data_ptr())
                assert not math.isfinite(copy_note.item())


def _noted(world, compiled: bool) -> list:
    """For each set-up (slot size, small-round threshold, element count, dtype): the summed tensor
    without notes and with them, and the notes; rank 1 holds a NaN in the last call of each set-up."""
    out = []
    for slot_bytes, small_bytes, numel in ((1 << 20, None, 1000), (1 << 20, None, 100_000), (1 << 20, 0, 100_000),
                                           (4096, None, 5000), (4096, 0, 5000)):
        group = ShmGroup(world=world, compiled=compiled, slot_bytes=slot_bytes, small_bytes=small_bytes)
        for dtype in (torch.float32, torch.float64):
            g = torch.Generator().manual_seed(10 * world.rank + numel)
            source = torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)
            plain, noted = source.clone(), source.clone()
            group.allreduce(plain)
            notes = torch.full((2,), 1.0, dtype=torch.float64)  # added to
            group.allreduce(noted, notes=notes)
            spoilt = source.clone()
            if world.rank == 1:
                spoilt[numel // 3] = float("nan")
            bad_notes = torch.zeros(2, dtype=torch.float64)
            group.allreduce(spoilt, notes=bad_notes)
            out.append((plain, noted, source.double().sum().item(), notes.tolist(), bad_notes.tolist()))
        out.append(group.rounds)
        group.close()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_the_shm_allreduce_notes_the_sums_as_it_moves_the_data(world_size, compiled):
    if compiled and shutil.which("cc") is None:
        pytest.skip("no C compiler: the rounds run in Python here")
    results = run_workers(_noted, world_size, compiled, timeout_s=120)
    for rank, calls in enumerate(results):
        rounds = [call for call in calls if isinstance(call, str)]
        assert set(rounds) == {"compiled" if compiled else "Python (not asked for)"}
        for index, call in enumerate(c for c in calls if not isinstance(c, str)):
            plain, noted, own, notes, bad_notes = call
            assert _bits(noted) == _bits(plain), f"rank {rank}, call {index}: notes changed the sum"
            total = plain.double().sum().item()
            scale = max(1.0, float(plain.double().abs().sum()))
            assert abs(notes[0] - 1.0 - own) <= 1e-5 * scale, (rank, index, notes, own)
            assert abs(notes[1] - 1.0 - total) <= 1e-5 * scale, (rank, index, notes, total)
            assert math.isfinite(bad_notes[0]) == (rank != 1), (rank, index, bad_notes)  # the NaN's own rank
            assert not math.isfinite(bad_notes[1]), (rank, index, bad_notes)  # every rank's sum


def _overflowing_step(world, algorithm: str) -> tuple[str, bool]:
    """One synced step whose gradient is finite on every rank and overflows float32 once summed (one
    element 3e38 on each rank): the check's verdict, and whether the exchange took its sums."""
    from phalanx.data_parallel import DataParallel, DataParallelConfig
    from phalanx.data_parallel.guards.checks import NonFinite

    torch.manual_seed(0)
    dp = DataParallel(torch.nn.Linear(4, 1), world=world,
                      options=DataParallelConfig(allreduce=algorithm, check_finite_every=1))
    weight = dp.module.weight
    (3e38 * weight[0, 0] + weight.sum() * 1e-3).backward()
    dp.finish_gradient_sync()  # checked before its update: the verdict waits for it (finite.py)
    torch.optim.SGD(dp.module.parameters(), lr=1.0).step()  # the summed Inf reaches the weights
    try:
        dp.check_finite()
        verdict = "none"
    except NonFinite as exc:
        verdict = str(exc)
    took = dp._finite._transport._pairs is not None
    dp._close()
    return verdict, took


@pytest.mark.parametrize("algorithm", ["shm", "native"])
def test_a_sum_that_overflows_is_named_whether_the_exchange_or_the_check_sums(algorithm):
    for verdict, took in run_workers(_overflowing_step, 2, algorithm, timeout_s=90):
        assert verdict.startswith("gradient NaN/Inf at step 1: the summed gradient overflowed although every rank's "
                                  "own was finite"), verdict
        assert took == (algorithm == "shm")  # the shm allreduce took the sums; gloo's leaves them to the check
