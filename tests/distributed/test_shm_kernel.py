"""The shm allreduce's compiled rounds (phalanx/comm/shm_kernel.c): the same bits as the Python
rounds, a sleeping peer woken at once by a publisher that skips the syscall when nobody sleeps,
compiled and Python ranks in one group, and a host without a usable compiler falling back named.

In the distributed tier: building the kernel runs the C compiler (a child process), and the
rounds need a group of processes. The sums against torch's own allreduce, every algorithm and
dtype, are in test_comm_allreduce.py (which runs both kinds of rounds).
"""

from __future__ import annotations

import os
import runpy
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from phalanx.comm import shm_kernel
from phalanx.comm.shm import LIVENESS_EVERY_S, ShmGroup, shm_supported, sum_into
from phalanx.runtime.board import COMM, Ticket
from tests.distributed.harness import run_workers

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(shm_supported() is not None, reason=f"no shm allreduce here: {shm_supported()}")]
needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the rounds run in Python here")


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def _rows(numel: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Values orders of magnitude apart, the first ones -0, 0, inf, NaN and a subnormal: what a
    sum in another order, or a sign of zero lost, would change the bits of."""
    rows = torch.randn(numel, generator=g, dtype=torch.float64)
    rows *= torch.exp(4 * torch.randn(numel, generator=g, dtype=torch.float64))
    rows = rows.to(dtype)
    specials = torch.tensor([-0.0, 0.0, float("inf"), float("nan"), torch.finfo(dtype).tiny / 4], dtype=dtype)
    rows[:len(specials)] = specials  # row 0's first values: -0 + -0 stays -0 only in order
    return rows


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_compiled_sum_adds_in_rank_order_to_the_same_bits(dtype):
    library, reason = shm_kernel.load()
    assert library is not None, reason
    g = torch.Generator().manual_seed(7)
    for k in range(2, 10):
        for n in (1, 3, 8, 17, 255, 4099):
            stride = n + 5  # elements between rows, as slots are apart in the segment
            rows = _rows(k * stride, dtype, g)
            rows[stride:stride + 1] = -0.0
            view = rows.as_strided((k, n), (stride, 1))
            expected = torch.empty(n, dtype=dtype)
            sum_into(expected, [view[r] for r in range(k)])
            got = torch.full((n,), 123.0, dtype=dtype)
            library.phx_sum_rows(got.data_ptr(), rows.data_ptr(), stride * rows.element_size(), k, n,
                                 shm_kernel.DTYPES[dtype])
            assert _bits(got) == _bits(expected), f"k={k} n={n}"


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_compiled_reduce_scatter_sum_reads_its_own_part_in_place_to_the_same_bits(dtype):
    library, reason = shm_kernel.load()
    assert library is not None, reason
    g = torch.Generator().manual_seed(11)
    for k in range(2, 10):
        for own in sorted({0, 1, k // 2, k - 1}):
            for n in (1, 3, 511, 512, 513, 1500):  # about the kernel's 512-element blocks
                stride = n + 3
                rows = _rows(k * stride, dtype, g)
                mine = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
                mine[:1] = -0.0
                view = rows.as_strided((k, n), (stride, 1))
                expected = mine.clone()
                scratch = torch.empty(n, dtype=dtype)  # shm_ops' Python rounds: partial sums in a scratch
                sum_into(expected, [expected if r == own else view[r] for r in range(k)], scratch=scratch)
                got = mine.clone()
                library.phx_sum_own(got.data_ptr(), rows.data_ptr(), stride * rows.element_size(), k, own, n,
                                    shm_kernel.DTYPES[dtype])
                assert _bits(got) == _bits(expected), f"k={k} own={own} n={n}"


def _reduce_scatters(world, compiled: bool) -> list[torch.Tensor]:
    """Reduce-scatters of uneven counts (one rank's empty), one window and several, both dtypes."""
    from phalanx.comm.shm_ops import reduce_scatter_shm

    out = []
    for slot_bytes in (1 << 20, 256):  # 256 bytes: a tensor streams through many rounds
        group = ShmGroup(world=world, compiled=compiled, slot_bytes=slot_bytes)
        for dtype in (torch.float32, torch.float64):
            g = torch.Generator().manual_seed(100 + world.rank)
            flat = (torch.randn(1001, generator=g, dtype=torch.float64)
                    * torch.exp(4 * torch.randn(1001, generator=g, dtype=torch.float64))).to(dtype)
            flat[world.rank] = float("nan") if world.rank == 1 else -0.0
            counts = [700, 0, 301][:world.world_size - 1] + [1001 - sum([700, 0, 301][:world.world_size - 1])]
            reduce_scatter_shm(flat, counts=counts, world=world, transport=group)
            out.append(flat)
        out.append(group.rounds)
        group.close()
    return out


@needs_cc
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_a_compiled_reduce_scatter_gives_the_python_rounds_bits(world_size):
    compiled = run_workers(_reduce_scatters, world_size, True, timeout_s=90)
    python = run_workers(_reduce_scatters, world_size, False, timeout_s=90)
    for rank in range(world_size):
        assert compiled[rank][2] == compiled[rank][5] == "compiled"
        assert python[rank][2] == "Python (not asked for)"
        for index in (0, 1, 3, 4):
            assert _bits(compiled[rank][index]) == _bits(python[rank][index]), f"rank {rank} result {index}"


def _all_gathers(world, compiled: bool) -> list:
    """All-gathers of uneven counts (one rank's empty), one window and several, four dtypes (a
    copy: any dtype), a rank late in some (the others copy out after their sleep)."""
    from phalanx.comm.shm_ops import all_gather_shm

    out = []
    for slot_bytes in (1 << 20, 256):  # 256 bytes: a tensor streams through many rounds
        group = ShmGroup(world=world, compiled=compiled, slot_bytes=slot_bytes)
        for call, dtype in enumerate((torch.float32, torch.float64, torch.bfloat16, torch.int64)):
            counts = [700, 0, 301][:world.world_size - 1] + [1001 - sum([700, 0, 301][:world.world_size - 1])]
            flat = torch.full((1001,), -7, dtype=dtype)  # what a rank's own range does not hold is overwritten
            lo = sum(counts[:world.rank])
            flat[lo:lo + counts[world.rank]] = torch.arange(lo, lo + counts[world.rank]).to(dtype)
            if world.rank == call % world.world_size:
                time.sleep(0.02)
            all_gather_shm(flat, counts=counts, world=world, transport=group)
            out.append(flat)
        out.append(group.rounds)
        group.close()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_compiled_all_gather_gives_every_rank_every_piece_as_the_python_rounds(world_size):
    if shutil.which("cc") is None:
        pytest.skip("no C compiler: the rounds run in Python here")
    compiled = run_workers(_all_gathers, world_size, True, timeout_s=90)
    python = run_workers(_all_gathers, world_size, False, timeout_s=90)
    for rank in range(world_size):
        assert compiled[rank][4] == compiled[rank][9] == "compiled" and python[rank][4] == "Python (not asked for)"
        for index in (0, 1, 2, 3, 5, 6, 7, 8):
            expected = torch.arange(1001).to(compiled[rank][index].dtype)
            assert _bits(compiled[rank][index]) == _bits(expected), f"rank {rank} result {index}"
            assert _bits(python[rank][index]) == _bits(expected), f"rank {rank} result {index}"



class _Counted:
    """The group's compiled rounds, counting the calls that copy or sum through them (not the flags')."""

    MOVING = {"small_round", "sum_slots", "sum_with_own", "reduce_scatter_round", "all_gather_round", "gather_out"}

    def __init__(self, rounds) -> None:
        self.rounds, self.calls = rounds, 0

    def __getattr__(self, name: str):
        self.calls += name in self.MOVING
        return getattr(self.rounds, name)


def _by_team(world, threads: tuple[int, ...]) -> list:
    """An allreduce of 4 KB, and one of 1 MB (small rounds, with two ranks: summed whole) and 1 MB in
    chunks, a reduce-scatter and an all-gather of 1 MB, each on a thread with `threads[rank]` intra-op
    threads: each result and how many calls went through the compiled rounds."""
    from phalanx.comm.shm_ops import all_gather_shm, reduce_scatter_shm

    torch.set_num_threads(threads[world.rank])
    out = []
    for small_bytes in (None, 0):
        group = ShmGroup(world=world, small_bytes=small_bytes)
        counted = group._flags.compiled = _Counted(group._flags.compiled)
        g = torch.Generator().manual_seed(5 + world.rank)
        for numel in (1024, 1 << 18):
            flat = _rows(numel, torch.float32, g)
            before = counted.calls
            group.allreduce(flat)
            out.append((flat, counted.calls - before))
        if small_bytes is None:
            counts = [(1 << 18) // 2, (1 << 18) - (1 << 18) // 2]
            for call in (reduce_scatter_shm, all_gather_shm):
                flat, before = _rows(1 << 18, torch.float64, g), counted.calls
                call(flat, counts=counts, world=world, transport=group)
                out.append((flat, counted.calls - before))
        group.close()
    return out


@needs_cc
def test_large_rounds_on_a_thread_with_an_intra_op_team_run_on_torchs_ops_to_the_same_bits():
    """The kernel sums on one thread; training's thread has a team that torch's ops use (shm_kernel.TEAM_NUMEL)."""
    assert shm_kernel.TEAM_NUMEL <= 1 << 18
    alone = run_workers(_by_team, 2, (1, 1), timeout_s=90)
    teamed = run_workers(_by_team, 2, (2, 2), timeout_s=90)
    mixed = run_workers(_by_team, 2, (2, 1), timeout_s=90)
    for rank in range(2):
        for index, (flat, calls) in enumerate(alone[rank]):
            assert calls > 0, f"rank {rank} call {index}: one thread, every round compiled"
            assert _bits(teamed[rank][index][0]) == _bits(mixed[rank][index][0]) == _bits(flat), (rank, index)
        # 4 KB, 1 MB, reduce-scatter, all-gather; chunked: 4 KB, 1 MB (a late peer adds a call)
        compiled = [calls > 0 for _, calls in teamed[rank]]
        assert compiled == [True, False, False, False, True, False], f"rank {rank}: {teamed[rank]}"
        assert [calls > 0 for _, calls in mixed[rank]] == (compiled if rank == 0 else [True] * 6)


def _late_peers(world, compiled_by_rank: tuple[bool, ...], small_bytes) -> dict:
    """Each rank in turn arrives 0.15 s late; the others' waits (spin, then futex) are timed."""
    group = ShmGroup(world=world, compiled=compiled_by_rank[world.rank], small_bytes=small_bytes)
    waits, sums = [], []
    for call in range(4):
        late = call % world.world_size
        flat = torch.full((1000,), float(world.rank + 1), dtype=torch.float64)
        if world.rank == late:
            time.sleep(0.15)
        start = time.perf_counter()
        group.allreduce(flat)
        if world.rank != late:
            waits.append(time.perf_counter() - start)
        sums.append(flat[0].item())
    rounds = group.rounds
    group.close()
    return dict(waits=waits, sums=sums, rounds=rounds)


@needs_cc
@pytest.mark.parametrize("compiled_by_rank,small_bytes", [
    ((True, True), None),  # every piece summed whole (one wait a round)
    ((True, True, True), 0),  # the chunked path: a second wait on the reduced flags
    ((True, False), None),  # a compiled rank and a Python one in one group
], ids=["compiled", "compiled-chunked", "mixed"])
def test_a_peer_asleep_on_the_futex_is_woken_when_the_late_rank_publishes(compiled_by_rank, small_bytes):
    k = len(compiled_by_rank)
    results = run_workers(_late_peers, k, compiled_by_rank, small_bytes, timeout_s=90)
    for rank, result in enumerate(results):
        assert result["sums"] == [k * (k + 1) / 2] * 4, f"rank {rank}"
        assert result["rounds"] == ("compiled" if compiled_by_rank[rank] else "Python (not asked for)")
        # A missed wake-up sleeps out the futex's bound (LIVENESS_EVERY_S) before it sees the flag.
        assert max(result["waits"]) < 0.15 + LIVENESS_EVERY_S / 2, f"rank {rank} woke late: {result['waits']}"


def _tags_in_rounds(world, compiled_by_rank: tuple[bool, ...]) -> list:
    """Small rounds whose tickets agree, differ in code or in size, or are absent; a peer arrives
    late in some (the sleeping path compares the tags after the wait): what each round said."""
    group = ShmGroup(world=world, compiled=compiled_by_rank[world.rank])
    said = []
    for call, tag in enumerate([(7, 32), (7, 32), (7 + world.rank, 32), (9, 32 + world.rank), (9, 32), None,
                                (11, 32)]):
        if call % 3 == 1 and world.rank == call % world.world_size:
            time.sleep(0.05)  # the others sleep on the futex for this rank
        ticket = None if tag is None else Ticket(COMM, call + 1, *tag)
        flat = torch.full((8,), float(world.rank + 1), dtype=torch.float32)
        said.append((group.allreduce(flat, ticket=ticket), flat[0].item()))
    said.append(group.rounds)
    group.close()
    return said


@pytest.mark.parametrize("compiled_by_rank", [(True, True), (False, False), (True, False, True)],
                         ids=["compiled", "python", "mixed"])
def test_a_small_round_says_whether_every_rank_carried_the_same_tag(compiled_by_rank):
    if any(compiled_by_rank) and shutil.which("cc") is None:
        pytest.skip("no C compiler: the rounds run in Python here")
    k = len(compiled_by_rank)
    total = k * (k + 1) / 2
    for rank, said in enumerate(run_workers(_tags_in_rounds, k, compiled_by_rank, timeout_s=90)):
        assert said[:-1] == [(True, total), (True, total), (False, total), (False, total), (True, total),
                             (False, total), (True, total)], f"rank {rank}"
        assert said[-1] == ("compiled" if compiled_by_rank[rank] else "Python (not asked for)")


def _build(monkeypatch, tmp_path, **env) -> shm_kernel.Loaded:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return shm_kernel.load.__wrapped__()  # not this process's cached result


def test_a_compiler_that_fails_leaves_python_rounds_and_says_why(monkeypatch, tmp_path):
    library, reason = _build(monkeypatch, tmp_path, CC="/bin/false")
    assert library is None and reason == "the C compiler failed: no message"
    library, reason = _build(monkeypatch, tmp_path, CC=str(tmp_path / "no-such-cc"))
    assert library is None and reason.startswith("the C compiler could not run:")
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()], "a failed build left a file"


def test_a_script_on_python_rounds_hears_it_once_from_rank_0(tmp_path):
    # phalanx train's first line names the Python rounds; a script's run said nothing (only
    # dp.choices.describe() did), so a slim container without a compiler ran 3-4x the CPU per round unawares.
    script = tmp_path / "script.py"
    script.write_text("import torch, phalanx\nworld = phalanx.init()\n"
                      "for _ in range(2):\n    phalanx.prepare(torch.nn.Linear(4, 2), world=world)\n")
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", "--quiet", str(script)],
                          capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    notes = [line for line in done.stderr.splitlines() if line.startswith("phalanx: note: the shm allreduce")]
    assert len(notes) == 1 and "rounds in Python (the C compiler could not run" in notes[0], done.stderr[-2000:]
    assert "install a C compiler" in notes[0]


@needs_cc
def test_cc_naming_a_command_line_builds_as_make_would(monkeypatch, tmp_path):
    # CC="ccache gcc" or "gcc -m64" is how make, setuptools and CMake take $CC; run as one path it
    # failed ("No such file or directory: 'gcc -m64'") and every round ran in Python.
    library, reason = _build(monkeypatch, tmp_path, CC=f"{shutil.which('cc')} -m64")
    assert library is not None, reason
    library, reason = _build(monkeypatch, tmp_path, CC="gcc 'unclosed")
    assert library is None and reason.startswith("$CC cannot be split into a command")


@needs_cc
def test_the_kernel_is_built_once_and_then_taken_from_the_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("CC", raising=False)
    library, reason = _build(monkeypatch, tmp_path)
    assert library is not None, reason
    built = [p.name for p in (tmp_path / "cache" / "phalanx" / "kernels").iterdir()]
    assert len(built) == 1 and built[0].startswith("shm_kernel-") and built[0].endswith(".so"), built

    def refuse(*args, **kwargs):
        raise AssertionError("compiled again although the cache holds the kernel")

    monkeypatch.setattr(subprocess, "run", refuse)
    library, reason = _build(monkeypatch, tmp_path)
    assert library is not None, reason


@needs_cc
def test_an_unwritable_cache_builds_privately(monkeypatch, tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory would go")
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    library, reason = shm_kernel.load.__wrapped__()
    assert library is not None, reason
    assert blocked.read_text().startswith("a file"), "the cache's place was overwritten"
    assert os.path.isfile(blocked)


@needs_cc
def test_the_round_cost_tool_times_both_kinds_of_rounds(capsys):
    tool = runpy.run_path(str(Path(__file__).parents[2] / "tools" / "shm_round_cost.py"))
    rows = tool["main"](["--sizes", "4096,65536", "--ranks", "2,3", "--calls", "20", "--rounds", "1"])
    assert [(r["size_bytes"], r["ranks"]) for r in rows] == [(4096, 2), (4096, 3), (65536, 2), (65536, 3)]
    assert all(r["compiled_rounds"] == "compiled" and r["python_us"] > 0 and r["compiled_us"] > 0 for r in rows)
    assert "4 KB, k = 3: Python" in capsys.readouterr().out


@needs_cc
def test_no_home_builds_privately_and_leaves_the_working_directory_alone(monkeypatch, tmp_path):
    # Before: os.path.expanduser left "~" as it was and the kernel was cached in ./~/.cache.
    from tests.unit.test_data_offline import _no_home

    monkeypatch.delenv("CC", raising=False)
    _no_home(monkeypatch, tmp_path)
    library, reason = shm_kernel.load.__wrapped__()
    assert library is not None, reason
    assert list(tmp_path.iterdir()) == []


def test_the_gap_probe_splits_every_contenders_step_against_the_lockstep_twin(capsys):
    # tools/gap_probe.py: what the next 16-core run asks (8 x 2 threads); here 2 x 1, a smoke.
    tool = runpy.run_path(str(Path(__file__).parents[2] / "tools" / "gap_probe.py"))
    rows = tool["main"](["--devices", "2", "--threads", "1", "--batch-sizes", "8", "--blocks", "2", "--steps", "1"])
    assert [r["contender"] for r in rows] == ["lockstep twin", "twin, gradient-sized meeting", "phalanx",
                                              "phalanx, no NaN/Inf check", "phalanx, rounds on the team",
                                              "phalanx, waits spin 1 ms", "phalanx overlapped"]
    assert rows[0]["step_vs_twin"] == 1.0 and all(r["step_vs_twin"] > 0 for r in rows)
    for row in rows:  # every phase timed; phalanx's exchange and the twin's meeting in "wait"
        assert list(row["ms_per_step"]) == ["forward", "backward", "wait", "optimizer", "other"], row
        assert min(row["ms_per_step"][p] for p in ("forward", "backward", "wait", "optimizer")) > 0, row
    assert "/ twin's 1.000" in capsys.readouterr().out
