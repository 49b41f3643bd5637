"""A BatchNorm model in a user's `phalanx run` script (and the DDP habits around it),
tests/distributed/ddp_habits_script.py on 1 and 2 workers, float64, 2 epochs of uneven batches:

- phalanx's way (`prepare`: SyncBatchNorm): 2 workers end within 1e-9 relative of 1 worker
  (docs/batchnorm.md's `sync` bound), every rank's buffers and parameters bitwise identical,
  saved with `torch.save(dp.state_dict())` and loadable into the plain model; rank 0 alone prints
  and writes metrics.jsonl, whose logged loss (`reduce`) matches 1 worker's.
- DDP's habits (a DataParallel built directly: plain BatchNorm; a mean loss; DistributedSampler
  on 303 examples): still bitwise-identical replicas, buffers included, and stderr names each
  habit once, in one line with its fix.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from phalanx.telemetry.metrics import read_metrics
from tests.distributed.ddp_habits_script import model

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "distributed" / "ddp_habits_script.py"
RTOL = 1e-9  # the sync policy's bound in float64 (docs/batchnorm.md measured 1.5e-13 after 2 epochs)


def phalanx_run(devices: str, out: Path, *flags: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", devices, "--timeout", "60",
                           str(SCRIPT), "--out", str(out), *flags],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def max_rel(a: dict, b: dict) -> float:
    return max(((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp_min(1e-30)).item()
               for k in b)


def load(out: Path, rank: int) -> dict:
    return torch.load(out / f"rank{rank}.pt", weights_only=True)


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory):
    out = tmp_path_factory.mktemp("k1")
    return phalanx_run("cpu:1", out), out


def test_sync_batchnorm_script_on_two_workers_equals_one(one_worker, tmp_path):
    ref_proc, ref_out = one_worker
    proc = phalanx_run("cpu:2", tmp_path)
    assert proc.stdout.splitlines()[0].startswith("replica: allreduce shm (auto: CPU workers on one host share memory)")
    assert proc.stdout.splitlines()[0].endswith(", BatchNorm sync (statistics of the whole global batch)")
    assert sum(line.startswith("epoch ") for line in proc.stdout.splitlines()) == 2  # rank 0 alone prints
    assert "PhalanxWarning" not in proc.stderr and "PhalanxWarning" not in ref_proc.stderr
    ranks = [load(tmp_path, r) for r in range(2)]
    reference = load(ref_out, 0)
    assert list(ranks[0]) == list(model().state_dict())  # no module. prefix: the plain model's keys
    for key in reference:  # replicas bitwise identical: parameters, running statistics, counts
        assert torch.equal(ranks[0][key], ranks[1][key]), key
    assert max_rel(ranks[0], reference) < RTOL
    initial = model().double().state_dict()
    assert max_rel(ranks[0], initial) > 1e-3  # it trained
    plain = model().double()
    plain.load_state_dict(ranks[0])
    rows, ref_rows = read_metrics(tmp_path / "metrics.jsonl"), read_metrics(ref_out / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [1, 2]
    for row, ref in zip(rows, ref_rows):  # the logged numbers are global: they match 1 worker's
        assert abs(row["train_loss_sum"] - ref["train_loss_sum"]) < 1e-9 * abs(ref["train_loss_sum"])
        assert row["test_acc"] == ref["test_acc"]


def test_ddp_habits_in_a_script_keep_replicas_identical_and_are_each_named_once(tmp_path):
    proc = phalanx_run("cpu:2", tmp_path, "--plain", "--mean-loss", "--distributed-sampler")
    warnings = [line for line in proc.stderr.splitlines() if "PhalanxWarning: " in line]
    assert len(warnings) == 3, proc.stderr[-3000:]  # each once, though 2 ranks ran 16 steps
    construction, loss, sampler = warnings  # each at the user's line: construction, then the first step
    assert "ddp_habits_script.py:" in construction
    assert "1 BatchNorm layer(s) normalize with each of the 2 devices' own shard" in construction
    assert "ddp_habits_script.py" in loss and "did not come through phalanx.shard_loss" in loss
    assert "torch's DistributedSampler pads the 303 examples to 304 by repeating 1" in sampler
    ranks = [load(tmp_path, r) for r in range(2)]
    for key in ranks[0]:
        assert torch.equal(ranks[0][key], ranks[1][key]), key
    assert ranks[0]["1.num_batches_tracked"].item() == 2 * 8  # 152 examples per rank in batches of 20, 2 epochs
