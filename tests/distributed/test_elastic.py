"""Restarts keep the exact trajectory (elastic.py): a worker SIGKILLed mid-run is restarted from the
last checkpoint and the run ends bitwise equal to an uninterrupted one; with --elastic, a device
whose worker keeps dying (runs.DEAD_ON_RESUME's driver makes it die at every restart) is given up
and the run finishes on the others, equal to the uninterrupted run to rounding (k devices compute
the 1-device update). Without --elastic the restarts run out and the run fails naming the rank.

float64 LeNet on synthetic data (its first 3,000 images), 3 CPU workers, 2 epochs of 24 steps of 128
images, a checkpoint every 5 steps; the victim is rank 1 (cpu:1), killed once the first checkpoint
is on disk. Under torchrun elastic (--nnodes 1:2, two agents on this host) a node that leaves is
resumed without, the same way.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.distributed.runs import (assert_same_rows, dead_on_resume_script, final_weights, finished_run, metrics_rows,
                                    relative_difference, started_phalanx)
from tests.distributed.test_faults import _children, _cmdline, _wait_for, _workers

pytestmark = pytest.mark.distributed

COMMON = ["train", "--devices", "cpu:3", "--dataset", "synthetic", "--train-examples", "3000", "--batch-size", "128",
          "--dtype", "float64", "--epochs", "2", "--checkpoint-every", "5", "--no-progress", "--threads-per-device", "1"]
TIMEOUT_S = 300
RESTART = (r"^phalanx: worker rank 1 \(cpu:1\) died \(signal SIGKILL\)[^;]*; restart 1 of 1 from "
           r"\S+checkpoint\.pt \(epoch 1, step (\d+)(, saved by rank 0 when rank 1 was lost)?\) "
           r"on 3 devices \[cpu:0, cpu:1, cpu:2\]$")


def _said(stderr: str) -> list[str]:
    """The launcher's own lines but the oversubscription warning (3 workers on a 2-core host)."""
    return [line for line in stderr.splitlines() if line.startswith("phalanx: ") and
            not line.startswith("phalanx: warning: ")]


def _signal_rank_1_after_the_first_checkpoint(*args: str, out: Path, sig: signal.Signals = signal.SIGKILL,
                                              env: dict | None = None, script: Path | None = None) -> tuple[int, str, str]:
    """Run `phalanx *args --out out`, send `sig` (a kill, or SIGSTOP: a frozen worker) to worker rank 1
    once the first checkpoint is on disk, and wait for the launcher: (exit code, stdout, stderr)."""
    with started_phalanx(*args, "--out", str(out), env=env, script=script) as proc:
        workers = _workers(proc.pid, 3)
        _wait_for(out / "checkpoints" / "checkpoint.pt")
        os.kill(workers[1], sig)
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    return proc.returncode, stdout, stderr


def _assert_bitwise_equal(got: Path, want: Path) -> None:
    a, b = final_weights(got, want)
    assert all(torch.equal(a[k], b[k]) for k in b), "a restarted run must end bitwise where the uninterrupted one does"
    assert_same_rows(got, want, rel=1e-12)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return finished_run(tmp_path_factory.mktemp("reference") / "run", *COMMON, timeout_s=TIMEOUT_S)


def test_a_killed_worker_is_restarted_and_the_run_ends_bitwise_equal(reference, tmp_path):
    out = tmp_path / "run"
    code, stdout, stderr = _signal_rank_1_after_the_first_checkpoint(*COMMON, "--max-restarts", "1", out=out)
    assert code == 0, stderr[-3000:]
    said = _said(stderr)
    assert len(said) == 1 and re.match(RESTART, said[0]), stderr[-3000:]
    assert "resumed from" in stdout and stdout.strip().splitlines()[-1].endswith("on [cpu:0, cpu:1, cpu:2]")
    _assert_bitwise_equal(out, reference)


def kill_rank_1_for_good(*args: str, tmp_path: Path) -> tuple[int, str, str, list[str]]:
    """`phalanx *args --max-restarts 1` whose rank 1 (cpu:1) is killed after the first checkpoint
    and dies again at every restart: (exit code, stdout, stderr, the launcher's own lines), the
    first of which must be the restart."""
    out = tmp_path / "run"
    code, stdout, stderr = _signal_rank_1_after_the_first_checkpoint(
        *args, "--max-restarts", "1", out=out, env={"DEAD_DEVICE": "cpu:1"}, script=dead_on_resume_script(tmp_path))
    said = _said(stderr)
    assert len(said) == 2 and re.match(RESTART, said[0]), stderr[-3000:]
    return code, stdout, stderr, said


def test_elastic_gives_up_a_device_that_keeps_dying_and_finishes_on_the_rest(reference, tmp_path):
    out = tmp_path / "run"
    code, stdout, stderr, said = kill_rank_1_for_good(*COMMON, "--elastic", tmp_path=tmp_path)
    assert code == 0, stderr[-3000:]
    step = re.match(RESTART, said[0]).group(1)
    assert re.match(rf"^phalanx: worker rank 1 \(cpu:1\) died \(signal SIGKILL\) again before the run got past "
                    rf"\S+checkpoint\.pt \(epoch 1, step {step}[^)]*\): giving cpu:1 up \(--elastic\); going on from "
                    rf"\S+checkpoint\.pt \(epoch 1, step {step}[^)]*\) on 2 devices \[cpu:0, cpu:2\]$", said[1]), said[1]
    assert f"at epoch 1, step {step}; changed since the checkpoint: devices 3 -> 2" in stdout, stdout[-2000:]
    assert stdout.strip().splitlines()[-1].endswith("on [cpu:0, cpu:2]")
    worst = relative_difference(out, reference)
    assert worst <= 1e-9, f"finished on 2 devices {worst:.3g} (relative) from the uninterrupted run"
    assert_same_rows(out, reference, rel=1e-9)
    assert metrics_rows(out)[-1]["devices"] == ["cpu:0", "cpu:2"]


def test_without_elastic_the_restarts_run_out_and_the_run_fails_naming_the_rank(tmp_path):
    out = tmp_path / "run"
    code, _, stderr, said = kill_rank_1_for_good(*COMMON, "--epochs", "20", tmp_path=tmp_path)
    assert code == 1, stderr[-3000:]
    assert said[1].startswith("phalanx: worker rank 1 failed: died (signal SIGKILL)"), said[1]
    assert not (out / "model.pt").exists()
    from phalanx.train import checkpoint as ckpt

    assert ckpt.read_checkpoint(out / "checkpoints")["epoch"] == 0  # the checkpoint it restarted from, whole


def test_under_torchrun_elastic_a_node_that_leaves_is_resumed_without_on_the_rest(reference, tmp_path):
    """Two torchrun agents on this host form one job (--nnodes 1:2, one worker each); the second
    agent and its worker are SIGKILLed after the first checkpoint. torchrun re-forms the job with
    the one node left, the job resumes by itself (TORCHELASTIC_RESTART_COUNT > 0) and ends within
    1e-9 of the uninterrupted run."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    assert torchrun
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = tmp_path / "run"
    agent = [torchrun, "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "2", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test",
             "--rdzv-conf", "last_call_timeout=10,join_timeout=120", "--monitor-interval", "0.5",
             "-m", "phalanx", *[a for a in COMMON if a not in ("--devices", "cpu:3")], "--allreduce", "native",
             "--timeout", "30", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = []
    try:
        for _ in range(2):
            agents.append(subprocess.Popen(agent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                           start_new_session=True))
            time.sleep(1.0)  # the first one hosts the rendezvous store
        _wait_for(out / "checkpoints" / "checkpoint.pt")
        leaving = agents[1]
        for pid in [p for p in _children(leaving.pid) if "phalanx" in _cmdline(p)] + [leaving.pid]:
            os.kill(pid, signal.SIGKILL)
        stdout, stderr = agents[0].communicate(timeout=TIMEOUT_S)
    finally:
        for proc in agents:
            if proc.poll() is None:  # torchrun starts its workers in sessions of their own: kill them first
                for pid in _children(proc.pid):
                    os.kill(pid, signal.SIGKILL)
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert agents[0].returncode == 0, stderr[-3000:]
    assert re.search(r"resumed from \S+checkpoint\.pt at epoch \d+, step \d+; changed since the checkpoint: "
                     r"devices 2 -> 1", stdout), stdout[-2000:]
    assert stdout.strip().splitlines()[-1].endswith("on [cpu:0]")
    worst = relative_difference(out, reference)
    assert worst <= 1e-9, f"finished on 1 node {worst:.3g} (relative) from the uninterrupted run"
    assert_same_rows(out, reference, rel=1e-9)


def test_a_frozen_worker_is_restarted_like_a_dead_one_and_the_run_ends_bitwise_equal(reference, tmp_path):
    """SIGSTOP instead of SIGKILL: the watchdog names the stopped rank within --timeout, the
    launcher takes the set down, and --max-restarts treats it as it treats a death (a worker that
    stopped answering is the machine's doing; a NaN loss or mismatched collectives would repeat)."""
    out = tmp_path / "run"
    code, _, stderr = _signal_rank_1_after_the_first_checkpoint(*COMMON, "--max-restarts", "1", "--timeout", "5",
                                                                out=out, sig=signal.SIGSTOP)
    assert code == 0, stderr[-3000:]
    said = _said(stderr)
    assert len(said) == 1 and re.match(r"^phalanx: worker rank 1 \(cpu:1\) stopped responding \(state: stopped\)"
                                       r".*; restart 1 of 1 from \S+checkpoint\.pt \(epoch 1, step \d+[^)]*\) on 3 devices "
                                       r"\[cpu:0, cpu:1, cpu:2\]$", said[0]), stderr[-3000:]
    _assert_bitwise_equal(out, reference)
