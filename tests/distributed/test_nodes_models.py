"""Replicas on several torchrun nodes compare their models and options at phalanx.prepare
(data_parallel/guards/nodes.py), where the per-host collective board cannot see the other
nodes: a model of another dtype on one node is one line on every node, not gloo aborting a
process at prepare's broadcast (SIGABRT, "Received data size doesn't match expected size")."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from phalanx.data_parallel.config import DataParallelConfig
from phalanx.data_parallel.guards.checks import ReplicaMismatch
from phalanx.data_parallel.guards.nodes import check_same_model
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parent / "scripts" / "dtype_per_node.py"


def _as_nodes(world, dtype_on_rank_1: str, cap_on_rank_1: float) -> str:
    """Each rank a node of its own (as torchrun's nodes of one worker), its model and options as given."""
    world = replace(world, node_rank=world.rank, node_sizes=(1,) * world.world_size)
    dtype = getattr(torch, dtype_on_rank_1) if world.rank == 1 else torch.float64
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).to(dtype)
    options = DataParallelConfig(bucket_cap_mb=cap_on_rank_1 if world.rank == 1 else 1.0)
    try:
        check_same_model(world, model, options)
    except ReplicaMismatch as exc:
        return str(exc)
    return "agreed"


def test_nodes_with_the_same_model_and_options_agree():
    assert run_workers(_as_nodes, 2, "float64", 1.0, timeout_s=90) == ["agreed", "agreed"]


def test_a_model_of_another_dtype_on_one_node_is_named_on_every_node():
    lines = run_workers(_as_nodes, 2, "float32", 1.0, timeout_s=90)
    assert lines[0] == lines[1] == (
        "the nodes prepared different models: 0.weight is float64 (16, 8) on rank 0 (node 0) and float32 (16, 8) on "
        "rank 1 (node 1) (a different model, dtype or code on that node?); build the same model on every rank before "
        "phalanx.prepare")


def test_other_options_on_one_node_are_named():
    lines = run_workers(_as_nodes, 2, "float64", 2.0, timeout_s=90)
    assert lines[0] == lines[1] == (
        "the nodes prepared their replicas with different options: bucket_cap_mb is 1.0 on rank 0 (node 0) and 2.0 "
        "on rank 1 (node 1); pass every rank the same phalanx.prepare arguments")


def test_a_script_on_two_torchrun_nodes_with_other_dtypes_stops_in_one_line_before_gloo():
    from tests.distributed.test_nodes_agree import _torchrun_nodes

    codes, done, _ = _torchrun_nodes([[str(SCRIPT)], [str(SCRIPT)]])
    assert codes == [1, 1]
    for out, err in done:
        assert "prepared" not in out and "EnforceNotMet" not in err and "SIGABRT" not in err, err[-3000:]
        assert "ReplicaMismatch: the nodes prepared different models: 0.weight is float64 (16, 8) on rank 0 (node 0) " \
               "and float32 (16, 8) on rank 1 (node 1)" in err, err[-3000:]
