"""The nodes of a torchrun job given different flags, or different phalanx code, stop before the
first step with one line naming the flag, its values and the ranks and nodes holding each
(phalanx/job/agreement.py) - instead of training on drifting replicas until close() noticed, or
gloo aborting a process, or a wait of --timeout.

Two spawned workers stand for two nodes (each builds its own TrainConfig, as each node parses
its own command line), and once two real torchrun agents (`--nnodes 2`) with different `--lr`.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx.errors import UsageError
from phalanx.job import agreement
from phalanx.job.agreement import check_same_run, check_same_start, run_flags, source_digest
from phalanx.job.config import TrainConfig
from phalanx.job.optim import OptimizerConfig
from phalanx.runtime.launch_config import LaunchConfig
from tests.conftest import write_digits_idx
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]


def _node_config(rank: int, lr_on_rank_1: float) -> TrainConfig:
    # Per-node paths and settings differ on purpose: they are each node's own.
    return TrainConfig(out_dir=f"/shared-{rank}/run", launch=LaunchConfig(timeout_s=60.0 + rank),
                       optim=OptimizerConfig(lr=lr_on_rank_1 if rank == 1 else 0.2))


def _across_nodes(world):
    """The harness's 2 local ranks as torchrun marks ranks that span nodes (World.node_sizes), which
    is where the nodes' agreement runs; node_rank stays this host's 0."""
    return dataclasses.replace(world, node_sizes=(1, 1))


def _check(world, lr_on_rank_1: float, code_on_rank_1: str | None) -> str:
    world = _across_nodes(world)
    if code_on_rank_1 is not None and world.rank == 1:
        agreement.code_identity.cache_clear()
        real = agreement.code_identity()
        agreement.code_identity = lambda: {**real, "phalanx": code_on_rank_1}
    check_same_run(world, _node_config(world.rank, lr_on_rank_1))
    return "agreed"


def _refusal(caught) -> str:
    """The refusal's line after its lead: `_check` and `_start` stand in for phalanx train's own
    code, so the line is led by where this file called phalanx (worker_errors.usage_line)."""
    lead = re.match(r"\S*test_nodes_agree\.py:\d+: ", str(caught.value))
    assert lead, str(caught.value)
    return str(caught.value)[lead.end():]


def test_per_node_paths_and_settings_agree():
    assert run_workers(_check, 2, 0.2, None, timeout_s=90) == ["agreed", "agreed"]


def test_a_different_lr_is_one_line_naming_the_flag_ranks_and_nodes():
    with pytest.raises(UsageError) as caught:
        run_workers(_check, 2, 0.1, None, timeout_s=90)
    line = _refusal(caught)
    assert "the nodes were started with different flags: --lr is 0.2 on rank 0 (node 0) and 0.1 on rank 1 " \
           "(node 0); give every node the same phalanx train command" in line, line
    assert "\n" not in line.strip(), line


def test_different_phalanx_sources_are_named():
    with pytest.raises(UsageError) as caught:
        run_workers(_check, 2, 0.2, "0.1.0 (sources 000000000000, at /elsewhere/phalanx)", timeout_s=90)
    line = _refusal(caught)
    assert line.startswith("the nodes run different code: phalanx 0.1.0 (sources "), line
    assert line.endswith("and phalanx 0.1.0 (sources 000000000000, at /elsewhere/phalanx) on rank 1 (node 0); install "
                         "the same phalanx and torch on every node"), line


def test_a_changed_constant_changes_the_source_digest(tmp_path):
    copy = tmp_path / "phalanx"
    shutil.copytree(REPO / "phalanx", copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert source_digest(copy) == source_digest(REPO / "phalanx")
    config = copy / "job" / "optim.py"
    config.write_text(config.read_text().replace('"sgd": 0.2,', '"sgd": 0.3,'))
    assert source_digest(copy) != source_digest(REPO / "phalanx")


def test_run_flags_leave_out_paths_and_keep_what_decides_the_update():
    one, other = run_flags(_node_config(0, 0.2)), run_flags(_node_config(1, 0.2))
    assert one == other and "--out" not in one and "--timeout" not in one
    assert {"--lr", "--epochs", "--dtype", "--allreduce", "--momentum", "--check-every"} <= set(one)
    assert run_flags(TrainConfig(optim=OptimizerConfig(lr=0.2)))["--lr"] == run_flags(TrainConfig())["--lr"]


def _two_nodes(per_node: list[list[str]]) -> tuple[list[int], list[tuple[str, str]], float]:
    """`phalanx train` as node 0 and node 1 of a torchrun job, each with its own extra flags."""
    common = ["-m", "phalanx", "train", "--epochs", "1", "--batch-size", "128", "--no-progress",
              "--threads-per-device", "1", "--timeout", "60"]
    return _torchrun_nodes([[*common, *extra] for extra in per_node])


def _torchrun_nodes(per_node: list[list[str]]) -> tuple[list[int], list[tuple[str, str]], float]:
    """Node n of a 2-node torchrun job runs per_node[n]; (exit codes, (stdout, stderr) each, seconds)."""
    from tests.distributed.test_two_nodes import _env, _free_port

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun, "torchrun ships with torch"
    port = _free_port()
    started = time.monotonic()
    agents = [subprocess.Popen([torchrun, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                                "--master-addr", "127.0.0.1", "--master-port", str(port), *argv],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
              for node, argv in enumerate(per_node)]
    try:
        done = [agent.communicate(timeout=180) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    return [agent.returncode for agent in agents], done, time.monotonic() - started


def test_two_torchrun_nodes_with_different_lr_stop_before_training(tmp_path):
    codes, done, elapsed = _two_nodes([["--dataset", "digits", "--lr", "0.2", "--out", str(tmp_path / "node0")],
                                       ["--dataset", "digits", "--lr", "0.1", "--out", str(tmp_path / "node1")]])
    assert codes == [1, 1]  # torchrun's own code for a failed worker
    line = ("phalanx: error: the nodes were started with different flags: --lr is 0.2 on rank 0 (node 0) and 0.1 "
            "on rank 1 (node 1); give every node the same phalanx train command (only torchrun's --node-rank differs)")
    for out, err in done:
        assert line in err.splitlines(), err[-3000:]
        assert "epoch" not in out and "replicas diverged" not in err
    assert not (tmp_path / "node0" / "model.pt").exists()
    assert elapsed < 120, elapsed


def test_two_nodes_whose_data_dirs_hold_different_images_stop_before_training(tmp_path):
    """Before: both trained to exit 0, each on its own data set."""
    dirs = [write_digits_idx(tmp_path / f"idx{seed}", num_train=600, num_test=200, seed=seed) for seed in (0, 1)]
    codes, done, _ = _two_nodes([["--data-dir", str(d)] for d in dirs])
    assert codes == [1, 1]
    for out, err in done:
        lines = [line for line in err.splitlines() if line.startswith("phalanx:")]
        assert len(lines) == 1 and lines[0].startswith("phalanx: error: the nodes read different data: fashion-mnist "
                                                       "(600 train / 200 test images, sha256 "), err[-3000:]
        assert lines[0].endswith("on rank 1 (node 1); give every node the same data set (the same files under "
                                 "--data-dir, or the same --dataset)"), lines[0]
        assert "epoch" not in out


def _start(world, node_1_start) -> str:
    world = _across_nodes(world)
    identity = {"name": "digits", "num_train": 1, "num_test": 1, "num_classes": 10, "train_sha256": "0" * 64}
    start = node_1_start if world.rank == 1 else (1, 0, "/shared/run/checkpoints/checkpoint.pt")
    check_same_start(world, data=lambda: identity, start=start and tuple(start), looked_in=f"/run-{world.rank}")
    return "agreed"


def test_a_node_that_cannot_see_the_checkpoint_is_named_before_it_starts_over():
    assert run_workers(_start, 2, [1, 0, "/mnt/run/checkpoints/checkpoint.pt"], timeout_s=90) == ["agreed"] * 2
    with pytest.raises(UsageError) as caught:
        run_workers(_start, 2, None, timeout_s=90)
    assert _refusal(caught) == (
        "the nodes would start from different places: from epoch 2, step 0 (/shared/run/checkpoints/checkpoint.pt) on "
        "rank 0 (node 0) and from scratch (no checkpoint in /run-1) on rank 1 (node 0); every node must read the same "
        "checkpoint: put --out (or --checkpoint-dir) on a filesystem every node sees")
