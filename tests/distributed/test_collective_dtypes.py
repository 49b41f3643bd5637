"""Ranks that pass `phalanx.allreduce` tensors of one size but different dtypes, on 2 gloo
processes: one line on every rank naming both dtypes and the cast, for each algorithm; of two
sizes, one line naming both, also over gloo's send/recv (ring). Before
2026-12-03 gloo aborted the process of the rank with the smaller dtype (SIGABRT in its own thread:
"Received data size doesn't match expected size") and its peer said only that the ranks were in
different collectives of two sizes; where the sizes agree (float32 and int32) the backend summed
the bytes of one as the other, without a word. The dtype rides in the board's tag word, and the
later rank to enter compares it before sending a byte (calls.enter)."""

from __future__ import annotations

import time

import pytest
import torch

import phalanx
from phalanx.comm import ShmGroup
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed


def _mismatched(world, algorithm: str, dtypes: tuple[str, str], sizes: tuple[int, int] = (8, 8)) -> str:
    """This rank's allreduce of its own size and dtype; the error it got, as a line."""
    tensor = torch.ones(sizes[world.rank], dtype=getattr(torch, dtypes[world.rank]))
    started = time.monotonic()
    try:
        if algorithm == "shm":
            with ShmGroup(world=world) as shm:
                phalanx.allreduce(tensor, world=world, algorithm=algorithm, transport=shm)
        else:
            phalanx.allreduce(tensor, world=world, algorithm=algorithm)
    except Exception as exc:  # noqa: BLE001 - what the user sees
        return f"{type(exc).__name__}: {exc} [{time.monotonic() - started:.1f} s]"
    return f"summed: {tensor.tolist()}"


@pytest.mark.parametrize("algorithm,dtypes", [("native", ("float32", "float64")), ("ring", ("float32", "float64")),
                                              ("shm", ("float32", "float64")), ("native", ("float32", "int32"))])
def test_different_dtypes_are_one_line_on_every_rank(algorithm, dtypes):
    for rank, said in enumerate(run_workers(_mismatched, 2, algorithm, dtypes, timeout_s=90)):
        assert said.startswith("CollectiveMismatch: ranks pass tensors of different dtypes to allreduce"), (rank, said)
        assert dtypes[0] in said and dtypes[1] in said and ".to(torch." in said and "\n" not in said, (rank, said)


@pytest.mark.parametrize("algorithm", ["native", "ring"])
def test_different_sizes_are_one_line_on_every_rank_not_gloos_abort(algorithm):
    said = run_workers(_mismatched, 2, algorithm, ("float32", "float32"), (8, 9), timeout_s=90)
    for rank, line in enumerate(said):
        assert line.startswith("CollectiveMismatch: ranks are in different collectives"), (rank, line)
        assert "(32 B)" in line and "(36 B)" in line and "\n" not in line, (rank, line)
