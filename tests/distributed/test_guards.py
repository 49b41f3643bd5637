"""Guards on 3 gloo processes: the pre-flight check names the rank and the field that differ,
the replica check names the rank and the parameter that drifted, the finite check names the
step and rank of a NaN. Every rank raises the same error at the same point (no rank hangs)."""

import pytest
import torch

from phalanx.models import LeNet
from phalanx.errors import RunFailed
from phalanx.data_parallel.guards.checks import check_finite, check_replicas, preflight_check
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed


def _outcome(fn) -> str:
    try:
        fn()
    except RunFailed as exc:
        return str(exc)
    return "ok"


def _worker(world) -> dict:
    out = {}
    same = {"model": "abc", "global_batch_size": 256, "seed": 0}
    out["preflight-same"] = _outcome(lambda: preflight_check(world, same))
    mine = same | ({"global_batch_size": 128} if world.rank == 2 else {})
    out["preflight-differs"] = _outcome(lambda: preflight_check(world, mine))
    torch.manual_seed(0)
    model = LeNet()
    out["replicas-same"] = _outcome(lambda: check_replicas(world, model, step=10))
    if world.rank == 1:
        with torch.no_grad():
            model.fc1.bias[3] += 1e-7  # one element of one replica drifts
    out["replicas-drift"] = _outcome(lambda: check_replicas(world, model, step=20))
    if world.rank == 1:  # a permutation keeps the sum: the weighted checksum must still see it
        with torch.no_grad():
            model.fc1.bias[3] -= 1e-7
            model.conv1.weight.view(-1)[[0, 1]] = model.conv1.weight.view(-1)[[1, 0]].clone()
    out["replicas-swap"] = _outcome(lambda: check_replicas(world, model, step=30))
    return out


@pytest.fixture(scope="module")
def results():
    return run_workers(_worker, 3, timeout_s=60)


def test_preflight_passes_when_ranks_agree(results):
    assert [r["preflight-same"] for r in results] == ["ok"] * 3


def test_preflight_names_the_rank_and_field_on_every_rank(results):
    messages = {r["preflight-differs"] for r in results}
    assert len(messages) == 1  # every rank raised the same error
    (message,) = messages
    assert message.startswith("pre-flight check: rank 2 differs from rank 0 in global_batch_size (128 vs 256)")


def test_replica_drift_names_the_rank_and_parameter(results):
    assert [r["replicas-same"] for r in results] == ["ok"] * 3
    for key, param, step in (("replicas-drift", "fc1.bias", 20), ("replicas-swap", "conv1.weight", 30)):
        messages = {r[key] for r in results}
        assert messages == {f"replicas diverged at step {step}: rank 1's {param} differs from rank 0's; the ranks "
                            "no longer apply identical updates (a rank-dependent code path or reduction?)"}


def test_check_finite_names_step_and_rank():
    check_finite(loss=torch.tensor(1.0), buffers=[torch.zeros(3)], step=1, rank=0)
    with pytest.raises(FloatingPointError, match="loss is nan at step 5 on rank 2; lower --lr"):
        check_finite(loss=torch.tensor(float("nan")), buffers=[], step=5, rank=2)
    with pytest.raises(FloatingPointError, match="gradient bucket 1 holds NaN/Inf at step 7 on rank 0"):
        check_finite(loss=None, buffers=[torch.zeros(2), torch.tensor([1.0, float("inf")])], step=7, rank=0)


def test_a_diverging_run_stops_with_one_line_naming_step_and_rank(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "phalanx", "train", "--devices", "cpu:2", "--dataset", "synthetic",
                           "--epochs", "2", "--lr", "1e6", "--no-progress", "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("phalanx: run stopped: loss is nan at step ")
    assert lines[0].endswith("; lower --lr or check the data")


def test_a_sharded_run_checked_every_step_passes(tmp_path):
    """Under --shard parameters the replica check compares the buffers: between steps each rank
    holds only its own range of the parameters, whatever the rest of their memory reads, so comparing
    parameters would report a difference where there is none."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "phalanx", "train", "--devices", "cpu:2", "--dataset", "synthetic",
                           "--shard", "parameters", "--check-every", "1", "--epochs", "1", "--no-progress",
                           "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def _nan_alike(world) -> str:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(float("nan"))  # the same NaN bits on every rank
    return _outcome(lambda: check_replicas(world, model, step=1))


def test_the_same_nan_on_every_rank_is_no_divergence():
    assert run_workers(_nan_alike, 2, timeout_s=60) == ["ok", "ok"]
