"""The watchdog end to end: a frozen worker ends the run within one --timeout
whatever the number of buckets in flight, named with its state; ranks in different collectives
fail at once naming both; a rank that finished normally while another waits is reported as
such; a forgotten finish_gradient_sync() with overlap=False is refused instead of letting the
replicas drift apart; the tag a caller passes (shm and native, every entry point) is what
its peer's mismatch error names; and a small shm call whose round compared the peers' tags
itself skips the board's pairing check, which every other call still makes."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from phalanx.comm import AsyncComm, CollectiveMismatch, Tag, allreduce
from phalanx.errors import UsageError
from phalanx.runtime.segment import shm_supported
from tests.distributed.harness import run_workers
from tests.distributed.test_faults import PHALANX, _wait_for, _workers, assert_all_gone

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 3  # --timeout of the frozen runs: the run must end within it + 5 s, not buckets x it
# Rank 1 runs one step fewer than rank 0 (8 global batches of 8), then evaluates, returns, or exits
# at once with code 0.
SHORT_BY_ONE = textwrap.dedent("""
    import os
    import sys
    import torch
    import torch.nn.functional as F
    from torch import nn
    import phalanx

    then, algorithm, overlap = sys.argv[1], sys.argv[2], sys.argv[3] == "overlap"
    world = phalanx.init()
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,)))
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    # One bucket of 131 float32s (524 B) and its 4 usage flags: 540 B on the wire.
    # "return": the checks are off, so close() makes no collective (on, it compares the replicas);
    # "close": close() checks the steps since the last NaN/Inf check.
    options = phalanx.DataParallelConfig(allreduce=algorithm, overlap=overlap, bucket_cap_mb=0.0005,
                                         check_finite_every=0 if then == "return" else 100)
    dp = phalanx.DataParallel(model, world=world, options=options)
    optimizer = torch.optim.SGD(dp.module.parameters(), lr=0.1)
    loader = phalanx.ShardedLoader(data, world=world, global_batch_size=8, seed=0)
    for step, ((X, y), global_size) in enumerate(loader.epoch(0)):
        if world.rank == 1 and step == 7:
            if then == "osexit0":
                os._exit(0)  # skips everything that marks its board line finished
            break
        dp.zero_grad()
        phalanx.shard_loss(F.cross_entropy(dp(X), y, reduction="sum"), global_size).backward()
        dp.finish_gradient_sync()
        optimizer.step()
    if then == "evaluate":
        phalanx.evaluate_dataset(dp.module, data, world=world)
    dp.close()
""")


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def stop_a_worker_mid_run(argv: list[str], out: Path) -> tuple[int, str, float, list[int]]:
    """Start `phalanx <argv> --out out` on 2 workers, SIGSTOP rank 1 once epoch 1 is done; return
    the exit code, stderr, seconds from the stop to the launcher's exit, and the workers' pids."""
    proc = subprocess.Popen([*PHALANX, *argv, "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=_env())
    try:
        workers = _workers(proc.pid, 2)
        _wait_for(out / "metrics.jsonl", timeout_s=240)
        os.kill(workers[1], signal.SIGSTOP)
        stopped_at = time.monotonic()
        _, stderr = proc.communicate(timeout=120)
        elapsed_s = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the workers share the launcher's process group
    return proc.returncode, stderr, elapsed_s, workers


def launcher_line(stderr: str) -> str:
    """The launcher's own first line (a worker's C++ runtime may print to stderr before it)."""
    return next((line for line in stderr.splitlines() if line.startswith("phalanx:")), stderr[-3000:])


FROZEN = {
    "lenet-3-buckets-shm": ["--model", "lenet"],
    "lenet-3-buckets-native": ["--model", "lenet", "--allreduce", "native", "--bucket-cap-mb", "0.25"],
    # 27 buckets queued on the communication thread: one timeout in all, not one per bucket
    # (which would be ~100 s at --timeout 5).
    "resnet-27-buckets": ["--model", "resnet", "--batchnorm", "local", "--bucket-cap-mb", "0.001"],
}


@pytest.mark.parametrize("case", FROZEN)
def test_a_frozen_worker_ends_the_run_within_one_timeout_naming_it(tmp_path, case):
    argv = ["train", "--devices", "cpu:2", "--dataset", "synthetic", "--epochs", "500", "--no-progress",
            "--timeout", str(TIMEOUT_S), *FROZEN[case]]
    returncode, stderr, elapsed_s, workers = stop_a_worker_mid_run(argv, tmp_path / "run")
    first = launcher_line(stderr)
    assert returncode == 1, stderr[-3000:]
    assert "worker rank 1 stopped responding (state: stopped) after step" in first, stderr[-3000:]
    # Where rank 0 waits depends on where the SIGSTOP lands: in a step's gradient bucket, or in
    # the stop check every step ends with (the run has somewhere to save, so it is armed).
    waits = rf"rank 0 waited {TIMEOUT_S} s in (step \d+'s gradient bucket \d+|stop check after step \d+) \([\d.]+ [KMG]?i?B\)"
    assert re.search(waits, first), first
    assert elapsed_s < TIMEOUT_S + 5, f"took {elapsed_s:.1f} s after the stop ({first})"
    assert_all_gone(workers)


def phalanx_run_short_by_one(tmp_path: Path, then: str, algorithm: str, overlap: str,
                             timeout_s: int = 60) -> tuple[int, str, float]:
    script = tmp_path / "short_by_one.py"
    script.write_text(SHORT_BY_ONE)
    started = time.monotonic()
    proc = subprocess.run([*PHALANX, "run", "--devices", "cpu:2", "--timeout", str(timeout_s), str(script), then,
                           algorithm, overlap], capture_output=True, text=True, timeout=240, env=_env())
    return proc.returncode, proc.stderr, time.monotonic() - started


@pytest.mark.parametrize("algorithm, overlap", [("shm", "overlap"), ("native", "overlap"), ("shm", "sync"),
                                                ("native", "sync")])
def test_ranks_in_different_collectives_fail_at_once_naming_both(tmp_path, algorithm, overlap):
    returncode, stderr, elapsed_s = phalanx_run_short_by_one(tmp_path, "evaluate", algorithm, overlap)
    first = launcher_line(stderr)
    assert returncode == 1, stderr[-3000:]
    assert first.startswith("phalanx: run stopped: ranks are in different collectives: "), stderr[-3000:]
    # evaluate_dataset's first collective compares the replicas (guards/replicas.py): 2 rows of 6 float64s.
    callers = r"phalanx\.checkpoint, evaluate_dataset, phalanx\.evaluate or dp\.close\(\) \(each compares the replicas first\)"
    sides = [rf"rank 1 is in replica check after step 7 \(96 B\), from {callers}; rank 0 in step 8's gradient bucket 0",
             rf"rank 0 is in step 8's gradient bucket 0 \(540 B\); rank 1 in replica check after step 7 \(\d+ B\), "
             rf"from {callers}"]
    assert any(re.search(side, first) for side in sides), first
    assert elapsed_s < 60, f"{elapsed_s:.0f} s: the 60 s timeout ran out instead"  # not a timeout: at once


@pytest.mark.parametrize("algorithm", ["shm", "native"])
def test_a_rank_that_finished_normally_while_another_waits_is_reported_as_such(tmp_path, algorithm):
    returncode, stderr, _ = phalanx_run_short_by_one(tmp_path, "return", algorithm, "overlap")
    first = launcher_line(stderr)
    assert returncode == 1, stderr[-3000:]
    assert ("phalanx: run stopped: rank 1 finished its work normally after step 7 while rank 0 waits for it in step "
            "8's gradient bucket 0 (540 B)") in first, stderr[-3000:]
    assert "died" not in stderr


@pytest.mark.parametrize("algorithm", ["shm", "native"])
def test_a_rank_that_exits_0_while_another_waits_is_the_rank_at_fault(tmp_path, algorithm):
    # os._exit(0) leaves no "finished" mark: the launcher, which saw it exit 0, names it, and the
    # waiter's "died" error is its echo (was: "worker rank 0 failed: ShmPeerGone ..." and a traceback).
    returncode, stderr, _ = phalanx_run_short_by_one(tmp_path, "osexit0", algorithm, "overlap")
    first = launcher_line(stderr)
    assert returncode == 1, stderr[-3000:]
    # The step its replica last synced, as its waiter's line says (the board told the launcher).
    assert first.startswith("phalanx: worker rank 1 failed: exited (code 0) without finishing its part after step 7 "
                            "while rank 0 waits for it in a collective; "), stderr[-3000:]
    assert "os._exit(0)" in first
    echo = next((line for line in stderr.splitlines() if line.startswith("rank 0 stopped too: ")), "")
    assert "rank 1 (pid " in echo and "after step 7 while rank 0 waited for it in step 8's gradient bucket 0" in echo, \
        stderr[-3000:]
    assert "Traceback" not in stderr


def test_a_rank_closing_while_another_waits_names_the_finite_check_it_is_in(tmp_path):
    returncode, stderr, elapsed_s = phalanx_run_short_by_one(tmp_path, "close", "shm", "overlap")
    first = launcher_line(stderr)
    assert returncode == 1, stderr[-3000:]
    sides = [r"rank 1 is in NaN/Inf check after step 7 \(32 B\), from phalanx\.checkpoint, dp\.full_state_dict\(\) or "
             r"dp\.close\(\) \(each checks the gradient first\); rank 0 in step 8's gradient bucket 0",
             r"rank 0 is in step 8's gradient bucket 0 \(540 B\); rank 1 in NaN/Inf check after step 7 \(\d+ B\), from "
             r"phalanx\.checkpoint"]
    assert any(re.search(side, first) for side in sides), first
    assert elapsed_s < 60, f"{elapsed_s:.0f} s: the 60 s timeout ran out instead"


def _forgets_finish_gradient_sync(world) -> list[float]:
    from phalanx.models import LeNet
    from phalanx.data_parallel import DataParallel, DataParallelConfig

    torch.manual_seed(0)
    with DataParallel(LeNet().double(), world=world, options=DataParallelConfig(overlap=False)) as dp:
        optimizer = torch.optim.SGD(dp.module.parameters(), lr=0.1)
        X = torch.rand(4, 1, 28, 28, dtype=torch.float64, generator=torch.Generator().manual_seed(world.rank))
        dp.zero_grad()
        F.cross_entropy(dp(X), torch.tensor([0, 1, 2, 3]), reduction="sum").backward()
        optimizer.step()  # dp.finish_gradient_sync() forgotten: each rank would step on its own gradient
    return [float(p.sum()) for p in dp.module.parameters()]


def test_a_forgotten_finish_gradient_sync_without_overlap_is_refused_at_the_step():
    # One line naming the step's line (errors.Misuse); a RuntimeError's traceback from every rank before 2026-12-06.
    with pytest.raises(UsageError) as info:
        run_workers(_forgets_finish_gradient_sync, 2, timeout_s=90)
    assert re.fullmatch(r"(.*/)?tests/distributed/test_watchdog\.py:\d+: optimizer\.step\(\) after a backward whose "
                        r"gradients were never summed across ranks: call dp\.finish_gradient_sync\(\) between "
                        r"loss\.backward\(\) and optimizer\.step\(\).*", str(info.value)), str(info.value)[-2000:]


# Rank 0 says its call is a checkpoint's, rank 1 a gradient bucket's: the same size, so the backend
# pairs them; what each rank's error names is the tag its peer passed.
TAGS = [Tag("checkpoint", step=3), Tag("gradient", 2, step=4)]
NAMED = ["rank 1 is in step 5's gradient bucket 2 (32 B); rank 0 in checkpoint after step 3 (32 B), from phalanx.checkpoint",
         "rank 0 is in checkpoint after step 3 (32 B), from phalanx.checkpoint; rank 1 in step 5's gradient bucket 2 (32 B)"]


def _mismatched_tags(world) -> dict:
    """Per algorithm and entry point, the mismatch this rank reported (or "no error")."""
    mine, out = TAGS[world.rank], {}
    # shm first: a mismatched native call is refused before it sends (calls.enter), so the rank that
    # launched first is left waiting until its next poll, and the ranks come to a later call up to
    # a poll apart - where shm's own poll, on the communication thread, would fail that thread.
    algorithms = ("native",) if shm_supported() is not None else ("shm", "native")
    with AsyncComm(world=world, algorithms=algorithms) as comm:
        for algorithm in algorithms:
            transport = comm.shm if algorithm == "shm" else None
            calls = {"async": lambda: comm.allreduce_async(torch.ones(8), algorithm=algorithm, tag=mine).wait(),
                     "sync": lambda: comm.allreduce(torch.ones(8), algorithm=algorithm, tag=mine),
                     "comm.allreduce": lambda: allreduce(torch.ones(8), world=world, algorithm=algorithm,
                                                         transport=transport, tag=mine)}
            for name, call in calls.items():
                try:
                    if algorithm == "native" and world.rank == 0:
                        _after_peer_entered(world)
                    call()
                    out[(algorithm, name)] = "no error"
                except CollectiveMismatch as exc:
                    out[(algorithm, name)] = str(exc)
    return out


def _after_peer_entered(world, deadline_s: float = 60.0) -> None:
    """Wait until rank 1 has entered one collective more than this rank. A mismatched native call
    is refused by whichever rank enters second, and the first's launched gloo op stays queued: were
    the first rank different from one call to the next, two such orphans would pair and complete,
    and the later call would find no peer entry to compare with (no error, in 2 of 4 runs). With
    rank 1 always first, only rank 1 leaves orphans, and nothing pairs."""
    board, until = world.board, time.monotonic() + deadline_s
    mine = sum(board.line(board.local_rank).entered)
    while sum(board.line(1).entered) <= mine:
        assert time.monotonic() < until, "rank 1 never entered its call"
        time.sleep(0.001)


@pytest.fixture(scope="module")
def mismatched():
    return run_workers(_mismatched_tags, 2, timeout_s=120)


@pytest.mark.parametrize("algorithm", ["native", "shm"])
def test_the_tag_a_caller_passes_is_what_its_peer_names(mismatched, algorithm):
    if algorithm == "shm" and shm_supported() is not None:
        pytest.skip(f"no shm allreduce here: {shm_supported()}")
    for rank, result in enumerate(mismatched):
        for name in ("async", "sync", "comm.allreduce"):
            message = result[(algorithm, name)]
            assert message.startswith(f"ranks are in different collectives: {NAMED[rank]}"), (rank, name, message)


def _pairing_checks(world, compiled: bool) -> dict:
    """Per kind of call, how many of three completed calls read the peers' board lines for their
    pairing (calls.check_pairing), and what each call raised."""
    import phalanx.comm.calls as calls

    real, counted, out = calls.check_pairing, [0], {}

    def counting(world, ticket) -> None:
        counted[0] += 1
        real(world, ticket)

    calls.check_pairing = counting
    try:
        with AsyncComm(world=world, algorithms=("native", "shm"), compiled_rounds=compiled) as comm:
            many = comm.shm.slot_bytes // 4 + 1  # floats: two rounds
            cases = {
                "shm": lambda: comm.allreduce(torch.ones(8), algorithm="shm", tag=Tag("evaluation")),
                "shm async": lambda: comm.allreduce_async(torch.ones(8), algorithm="shm",
                                                          tag=Tag("gradient", 1, step=0)).wait(),
                "shm, two rounds": lambda: comm.allreduce(torch.ones(many), algorithm="shm"),
                "shm reduce-scatter": lambda: comm.reduce_scatter(torch.ones(8), counts=[3, 5], algorithm="shm"),
                "shm all-gather": lambda: comm.all_gather_async(torch.ones(8), counts=[8, 0], algorithm="shm").wait(),
                "shm all-gather, two rounds": lambda: comm.all_gather(torch.ones(many), counts=[many - 1, 1],
                                                                      algorithm="shm"),
                "native": lambda: comm.allreduce(torch.ones(8), algorithm="native"),
                # A generic tag pairs with a named one of the same size and kind: the round sees the
                # codes differ, the board says that is no mismatch.
                "shm, generic beside named": lambda: comm.allreduce(
                    torch.ones(8), algorithm="shm", tag=Tag() if world.rank == 0 else Tag("metrics")),
                # Named differently: the round sees it, the board names it (and the first call raises).
                "shm reduce-scatter, mismatched": lambda: comm.reduce_scatter(
                    torch.ones(8), counts=[4, 4], algorithm="shm", tag=Tag("gradient", 1, step=0) if world.rank == 0
                    else Tag("parameters", 1, step=0)),
            }
            for name, call in cases.items():
                counted[0] = 0
                try:
                    for _ in range(3):
                        call()
                    out[name] = (counted[0], "no error")
                except CollectiveMismatch as exc:
                    out[name] = (counted[0], str(exc))
    finally:
        calls.check_pairing = real
    return out


@pytest.mark.skipif(shm_supported() is not None, reason=f"no shm allreduce here: {shm_supported()}")
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python-rounds"])
def test_a_small_shm_call_is_paired_in_its_round_and_every_other_call_on_the_board(compiled):
    for rank, result in enumerate(run_workers(_pairing_checks, 2, compiled, timeout_s=120)):
        mismatch = result.pop("shm reduce-scatter, mismatched")
        # native: twice a call, before it starts (gloo aborts on a size it did not expect) and once it completed.
        assert result == {"shm": (0, "no error"), "shm async": (0, "no error"), "shm, two rounds": (3, "no error"),
                          "shm reduce-scatter": (0, "no error"), "shm all-gather": (0, "no error"),
                          "shm all-gather, two rounds": (3, "no error"), "native": (6, "no error"),
                          "shm, generic beside named": (3, "no error")}, rank
        assert mismatch[0] == 1 and mismatch[1].startswith("ranks are in different collectives: "), (rank, mismatch)
