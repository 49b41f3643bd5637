"""Calls made in another tool's way where a phalanx function stands (runtime/call_habits.py): the World
handed by position or not at all, torch.distributed's keywords on init and allreduce, torch's ReduceOp,
DataLoader's per-rank batch_size, each one line naming phalanx's call; phalanx's own calls as before."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn

import phalanx
from phalanx.runtime.world import World

WORLD1 = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), backend="none",
               timeout_s=5.0)
DATASET = torch.utils.data.TensorDataset(torch.randn(6, 2), torch.arange(6) % 2)


def _calls(world):
    """Each public call that takes world= by keyword, with `world` handed by position (None: left out)."""
    model = nn.Linear(2, 2)
    given = () if world is None else (world,)
    return {
        "allreduce": lambda: phalanx.allreduce(torch.ones(2), *given),
        "barrier": lambda: phalanx.barrier(*given),
        "broadcast": lambda: phalanx.broadcast(1, *given),
        "gather": lambda: phalanx.gather(torch.ones(2), *given),
        "main_first": lambda: phalanx.main_first(*given).__enter__(),
        "reduce": lambda: phalanx.reduce(1.0, *given),
        "evaluate": lambda: phalanx.evaluate(model, torch.ones(2, 2), torch.zeros(2, dtype=torch.int64), *given),
        "evaluate_dataset": lambda: phalanx.evaluate_dataset(model, DATASET, *given),
        "ShardedLoader": lambda: phalanx.ShardedLoader(DATASET, *given, global_batch_size=4),
        "BatchRandom": lambda: phalanx.BatchRandom(*given),
    }


@pytest.mark.parametrize("name", sorted(_calls(None)))
def test_the_world_by_position_or_left_out_names_the_call_with_world_by_keyword(name):
    # torch.distributed's habit (all_reduce(t, group), barrier(group)) and a forgotten world=: before
    # 2026-12-06 Python's "takes 1 positional argument but 2 were given" / "missing 1 required
    # keyword-only argument: 'world'", which named no fix.
    with pytest.raises(TypeError) as by_position:
        _calls(WORLD1)[name]()
    message = str(by_position.value)
    match = re.fullmatch(rf"{name}\(\) takes the World by keyword: phalanx\.{name}\((.*)\)", message)
    assert match, message
    with pytest.raises(TypeError) as left_out:
        _calls(None)[name]()
    assert str(left_out.value) == f"{name}() needs world=: world = phalanx.init() once, then phalanx.{name}({match[1]})"
    # The call named is the function's own: its required arguments, world= by keyword, nothing else.
    target = getattr(phalanx, name)
    params = inspect.signature(target.__init__ if inspect.isclass(target) else target).parameters
    for argument in match[1].split(", "):
        keyword = argument.partition("=")[0]
        assert keyword in params, (name, keyword)
        assert ("=" in argument) == (params[keyword].kind == inspect.Parameter.KEYWORD_ONLY), (name, argument)


def test_prepare_and_checkpoint_name_the_world_by_position_before_their_own_refusals(tmp_path):
    # prepare(model, world) said "prepare takes the model alone, got World after it (Accelerate's ...)";
    # checkpoint(path, world, ...) that it was Fabric's save(path, state).
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"^prepare\(\) takes the World by keyword: phalanx\.prepare\(model, "
                                        r"world=world\)$"):
        phalanx.prepare(model, WORLD1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"^checkpoint\(\) takes the World by keyword: phalanx\.checkpoint\(location, "
                                        r"world=world, model=\.\.\., optimizer=\.\.\., epoch=\.\.\., "
                                        r"global_batch_size=\.\.\., seed=\.\.\.\)$"):
        phalanx.checkpoint(tmp_path / "ck", WORLD1, model=model, optimizer=optimizer, epoch=0, global_batch_size=2,
                           seed=0)
    with pytest.raises(TypeError, match=r"^checkpoint\(str, dict\) is another tool's order"):  # as before
        phalanx.checkpoint(str(tmp_path / "ck"), {"model": model})
    assert not (tmp_path / "ck").exists()


def test_phalanx_s_own_calls_run_as_before():
    assert phalanx.reduce(3, world=WORLD1, op="sum") == 3
    assert torch.equal(phalanx.gather(torch.ones(2), world=WORLD1), torch.ones(2))
    assert phalanx.broadcast({"a": 1}, world=WORLD1) == {"a": 1}
    phalanx.barrier(world=WORLD1)
    with phalanx.main_first(world=WORLD1, per_host=True):
        pass
    assert [size for _, size in phalanx.ShardedLoader(DATASET, world=WORLD1, global_batch_size=4).epoch(0)] == [4, 2]
    for name in ("reduce", "allreduce", "init", "main_first"):  # help() shows the keywords, not **other_tools
        assert "**" not in str(inspect.signature(getattr(phalanx, name))), name
    assert list(inspect.signature(phalanx.ShardedLoader).parameters)[:3] == ["dataset", "world", "global_batch_size"]


def test_torch_s_reduce_ops_are_taken_as_their_names():
    # reduce(t, op=ReduceOp.SUM), as dist.all_reduce takes it, said "reduce op <RedOpType.SUM: 0> is unknown".
    for torch_op, name in ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.AVG, "mean"), (dist.ReduceOp.MAX, "max"),
                           (dist.ReduceOp.MIN, "min")):
        for value in (3, 2.5, torch.tensor([1.0, -2.0])):
            got, want = phalanx.reduce(value, world=WORLD1, op=torch_op), phalanx.reduce(value, world=WORLD1, op=name)
            assert type(got) is type(want) and (torch.equal(got, want) if isinstance(got, torch.Tensor) else got == want)
    with pytest.raises(ValueError, match=r"^reduce op <RedOpType.PRODUCT: 2> is unknown; choose one of mean, sum, "
                                         r"max, min$"):
        phalanx.reduce(2.0, world=WORLD1, op=dist.ReduceOp.PRODUCT)


@dataclass
class _TwoRanks:  # what data/loader.py needs of a world, as ShardedLoader's tests hand it
    rank: int = 0
    world_size: int = 2


def test_dataloader_s_per_rank_batch_size_names_the_global_one():
    with pytest.raises(TypeError, match=r"^ShardedLoader takes global_batch_size=, the batch of all ranks together, "
                                        r"not batch_size= \(DataLoader's, per rank under a DistributedSampler\): "
                                        r"batch_size=4 on 2 ranks is global_batch_size=8$"):
        phalanx.ShardedLoader(DATASET, world=_TwoRanks(), batch_size=4)
    with pytest.raises(ValueError, match=r"^ShardedLoader decides batch_size itself"):  # both given: as before
        phalanx.ShardedLoader(DATASET, world=_TwoRanks(), global_batch_size=8, batch_size=4)


def test_stop_requested_given_the_world_or_the_model_names_the_replica():
    for given in (WORLD1, nn.Linear(2, 2)):
        with pytest.raises(TypeError, match=rf"^stop_requested takes the replica, got {type(given).__name__}: "
                                            r"phalanx\.stop_requested\(dp\), dp being phalanx\.prepare\(model, "
                                            r"world=world\)$"):
            phalanx.stop_requested(given)
