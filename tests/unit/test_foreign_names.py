"""Accelerate's and Fabric's habits on phalanx's objects: a name phalanx spells differently is an
AttributeError (on the World) or a TypeError (prepare) naming phalanx's way in one line, and
every way named exists."""

from __future__ import annotations

import copy
import inspect
import pickle
import re

import pytest
import torch
from torch import nn

import phalanx
from phalanx.data_parallel import DataParallel
from phalanx.runtime.call_habits import CALL_KEYWORDS, CALL_ORDERS
from phalanx.runtime.foreign_names import DDP_KEYWORDS, DDP_METHODS, FOREIGN_NAMES
from phalanx.runtime.world import World

WORLD1 = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), backend="none",
               timeout_s=5.0)


@pytest.mark.parametrize("name", sorted(FOREIGN_NAMES))
def test_another_tool_s_name_on_the_world_names_phalanx_s_way(name):
    whose, way = FOREIGN_NAMES[name]
    with pytest.raises(AttributeError) as info:
        getattr(WORLD1, name)
    message = str(info.value)
    assert message == f"'World' object has no attribute {name!r} ({whose} name): in phalanx, {way}"
    assert "\n" not in message and not hasattr(WORLD1, name)


def test_names_the_world_has_are_its_own_and_the_rest_plain():
    for own in ("device", "local_rank", "world_size", "node_rank", "print", "rank", "is_main"):
        assert own not in FOREIGN_NAMES and hasattr(WORLD1, own)
    with pytest.raises(AttributeError, match=r"^'World' object has no attribute 'nonsense'$"):
        WORLD1.nonsense
    # What copies and pickling look up still finds nothing, and a World still travels to workers.
    assert pickle.loads(pickle.dumps(WORLD1)) == WORLD1 and copy.deepcopy(WORLD1) == WORLD1


def test_every_way_named_exists():
    ways = " ".join(way for _, way in FOREIGN_NAMES.values())
    for name in re.findall(r"phalanx\.(\w+)", ways):
        assert name in phalanx.__all__, name
    with DataParallel(nn.Linear(2, 2), world=WORLD1) as dp:
        for name in re.findall(r"\bdp\.(\w+)", ways):
            assert hasattr(dp, name), name
    for name in re.findall(r"\bworld\.(\w+)", ways):
        assert hasattr(WORLD1, name), name


def test_prepare_takes_the_model_alone_and_needs_a_world():
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError) as info:
        phalanx.prepare(model, optimizer, world=WORLD1)
    message = str(info.value)
    assert message.startswith("prepare takes the model alone, got SGD after it (Accelerate's prepare(model, ")
    assert "phalanx.ShardedLoader" in message and "\n" not in message
    with pytest.raises(TypeError, match=r"^prepare needs world=: world = phalanx.init\(\), then "):
        phalanx.prepare(model)
    with phalanx.prepare(model, world=WORLD1) as dp:  # the plain call is unchanged
        assert dp.module is model


@pytest.mark.parametrize("keyword", sorted(DDP_KEYWORDS))
def test_a_ddp_keyword_handed_to_prepare_names_phalanx_s_way(keyword):
    with pytest.raises(TypeError) as info:
        phalanx.prepare(nn.Linear(2, 2), world=WORLD1, **{keyword: True})
    message = str(info.value)
    assert message == f"prepare() takes no {keyword}= (DistributedDataParallel's keyword): {DDP_KEYWORDS[keyword]}"
    assert "\n" not in message


def test_another_unknown_keyword_is_python_s_own_error_and_every_ddp_way_exists():
    with pytest.raises(TypeError, match=r"^prepare\(\) got an unexpected keyword argument 'lr'$"):
        phalanx.prepare(nn.Linear(2, 2), world=WORLD1, lr=0.1)
    fields = set(phalanx.DataParallelConfig.__dataclass_fields__)
    keywords = set(inspect.signature(phalanx.prepare).parameters)
    for way in [*DDP_KEYWORDS.values(), *DDP_METHODS.values()]:  # a keyword named is one its call takes
        for config, name in re.findall(r"(DataParallelConfig\()?(\w+)=", way):
            assert name in (fields if config else keywords), name


def test_every_keyword_of_torch_s_ddp_is_prepare_s_own_or_named():
    """What this torch's DistributedDataParallel takes, handed to prepare, is never Python's bare
    "unexpected keyword argument": prepare takes it, or one line names phalanx's way."""
    ddp = set(inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters) - {"self", "module"}
    missing = sorted(ddp - set(inspect.signature(phalanx.prepare).parameters) - set(DDP_KEYWORDS))
    assert not missing, f"DDP keywords neither prepare's nor in DDP_KEYWORDS: {missing}"


@pytest.mark.parametrize("name", sorted(DDP_METHODS))
def test_a_ddp_method_asked_of_the_replica_names_phalanx_s_way(name):
    with phalanx.prepare(nn.Linear(2, 2), world=WORLD1) as dp:
        with pytest.raises(AttributeError) as info:
            getattr(dp, name)
        assert str(info.value) == (f"'DataParallel' object has no attribute {name!r} (DistributedDataParallel's "
                                   f"method): in phalanx, {DDP_METHODS[name]}")
        assert not hasattr(dp, name) and "\n" not in str(info.value)
        with pytest.raises(AttributeError, match=r"^'DataParallel' object has no attribute 'reducer'$"):
            dp.reducer  # another missing name: torch's own message
        assert dp.module.weight is dp.module.weight  # submodules and parameters as before


def test_require_backward_grad_sync_is_the_switch_no_sync_turns():
    with phalanx.prepare(nn.Linear(2, 2), world=WORLD1) as dp:
        assert dp.require_backward_grad_sync is True and dp.sync_enabled
        with dp.no_sync():
            assert dp.require_backward_grad_sync is False
        dp.require_backward_grad_sync = False
        assert not dp.sync_enabled and "require_backward_grad_sync" not in dp.__dict__
        dp.require_backward_grad_sync = 1
        assert dp.require_backward_grad_sync is True


@pytest.mark.parametrize("name", ["no_backward_sync", "clip_gradients", "clip_grad_norm_", "unwrap_model"])
def test_a_fabric_or_accelerate_name_asked_of_the_replica_names_phalanx_s_way(name):
    whose, way = FOREIGN_NAMES[name]
    with phalanx.prepare(nn.Linear(2, 2), world=WORLD1) as dp:
        with pytest.raises(AttributeError) as info:
            getattr(dp, name)
        assert str(info.value) == f"'DataParallel' object has no attribute {name!r} ({whose} name): in phalanx, {way}"


@pytest.mark.parametrize("name", ["save", "load", "seed_everything", "all_reduce", "all_gather", "setup", "backward"])
def test_a_fabric_or_accelerate_name_asked_of_the_module_names_phalanx_s_way(name):
    # A port writes `phalanx.save(...)` where it had `fabric.save(...)` as often as `world.save`.
    whose, way = FOREIGN_NAMES[name]
    with pytest.raises(AttributeError) as info:
        getattr(phalanx, name)
    assert str(info.value) == f"module 'phalanx' has no attribute {name!r} ({whose} name): in phalanx, {way}"
    with pytest.raises(AttributeError, match=r"^module 'phalanx' has no attribute 'nothing_of_the_kind'$"):
        phalanx.nothing_of_the_kind


# Fabric 2.6's public names a script calls on its `fabric` (World has device, local_rank, node_rank,
# world_size and print itself); before 2026-12-03 call, callbacks, accelerator, init_tensor and
# load_raw were Python's bare "has no attribute".
FABRIC_PUBLIC = ("all_gather", "all_reduce", "autocast", "backward", "barrier", "broadcast", "call", "callbacks",
                 "accelerator", "clip_gradients", "global_rank", "init_module", "init_tensor", "is_global_zero",
                 "launch", "load", "load_raw", "log", "log_dict", "logger", "loggers", "no_backward_sync",
                 "rank_zero_first", "save", "seed_everything", "setup", "setup_dataloaders", "setup_module",
                 "setup_optimizers", "strategy", "to_device")


@pytest.mark.parametrize("name", FABRIC_PUBLIC)
def test_every_fabric_name_a_script_calls_is_named_on_the_world(name):
    with pytest.raises(AttributeError, match=rf"^'World' object has no attribute '{name}' \(.*Fabric's name\): in "
                                             r"phalanx, "):
        getattr(WORLD1, name)


@pytest.mark.parametrize("call, name", sorted(CALL_KEYWORDS))
def test_another_tool_s_keyword_on_a_phalanx_call_names_phalanx_s_way(call, name):
    # A port writes phalanx.init(accelerator="cpu", devices=2) for Fabric(...), reduce(t, reduce_op="sum")
    # for fabric.all_reduce, main_first(local=True) for rank_zero_first: before 2026-12-03 Python's bare
    # "got an unexpected keyword argument"; clip_grad_value_(dp, clip_val=) for fabric.clip_gradients
    # (and clip_val= / max_norm= on the other clip) met it until 2026-12-04.
    whose, way = CALL_KEYWORDS[call, name]
    dp = phalanx.prepare(nn.Linear(2, 2), world=WORLD1)
    calls = {"init": lambda **kw: phalanx.init(**kw),
             "reduce": lambda **kw: phalanx.reduce(torch.tensor(1.0), world=WORLD1, **kw),
             "allreduce": lambda **kw: phalanx.allreduce(torch.ones(2), world=WORLD1, **kw),
             "main_first": lambda **kw: phalanx.main_first(world=WORLD1, **kw).__enter__(),
             "clip_grad_norm_": lambda **kw: phalanx.clip_grad_norm_(dp, **kw),
             "clip_grad_value_": lambda **kw: phalanx.clip_grad_value_(dp, **kw)}
    with pytest.raises(TypeError) as info:
        calls[call](**{name: 1})
    assert str(info.value) == f"{call}() takes no {name}= ({whose} keyword): in phalanx, {way}"
    with pytest.raises(TypeError, match=rf"^{call}\(\) got an unexpected keyword argument 'nonsense'$"):
        calls[call](nonsense=1)
    dp.close()


def test_fabric_s_clip_val_with_its_optimizer_names_the_clip_by_value():
    with phalanx.prepare(nn.Linear(2, 2), world=WORLD1) as dp:
        optimizer = torch.optim.SGD(dp.parameters(), lr=0.1)
        with pytest.raises(TypeError, match=r"^clip_grad_value_\(\) takes no clip_val= \(Fabric's clip_gradients "
                                            r"keyword\): in phalanx, clip_value=: phalanx.clip_grad_value_\(dp, value\), "
                                            r"after dp.finish_gradient_sync\(\): no optimizer$"):
            phalanx.clip_grad_value_(dp, optimizer, clip_val=0.5)
        with pytest.raises(TypeError, match=r"^clip_grad_norm_\(\) takes no clip_val= .*a clip by value is "
                                            r"phalanx.clip_grad_value_\(dp, value\)"):
            phalanx.clip_grad_norm_(dp, optimizer, clip_val=0.5)


def test_the_ways_the_keywords_name_exist():
    ways = " ".join(way for _, way in [*CALL_KEYWORDS.values(), *CALL_ORDERS.values()])
    for name in re.findall(r"phalanx\.(\w+)", ways):
        assert name in phalanx.__all__, name
    assert "per_host" in inspect.signature(phalanx.main_first).parameters
    assert "op" in inspect.signature(phalanx.reduce).parameters


def test_a_sharded_loader_iterated_as_fabric_s_loader_names_epoch():
    # Fabric's setup_dataloaders loader is iterated itself (`for x, y in loader:`); before 2026-12-03
    # the ported loop met Python's bare "'ShardedLoader' object is not iterable".
    dataset = torch.utils.data.TensorDataset(torch.randn(6, 2), torch.arange(6))
    loader = phalanx.ShardedLoader(dataset, world=WORLD1, global_batch_size=4)
    with pytest.raises(TypeError, match=r"^a ShardedLoader is read an epoch at a time: for batch, global_size in "
                                        r"loader.epoch\(epoch\): "):
        for _ in loader:
            pass
    assert [size for _, size in loader.epoch(0)] == [4, 2]


def test_a_sharded_loader_asked_for_distributed_sampler_s_set_epoch_or_a_batch_size_names_phalanx_s_way():
    # A DDP loop calls sampler.set_epoch(epoch) and reads loader.batch_size: Python's bare "has no attribute"
    # before 2026-12-06.
    dataset = torch.utils.data.TensorDataset(torch.randn(6, 2), torch.arange(6))
    loader = phalanx.ShardedLoader(dataset, world=WORLD1, global_batch_size=4)
    with pytest.raises(AttributeError, match=r"^'ShardedLoader' object has no attribute 'set_epoch': DistributedSampler's "
                                             r"set_epoch is loader.epoch's argument: for batch, global_size in "
                                             r"loader.epoch\(epoch\): \.\.\. draws that epoch's order on every rank$"):
        loader.set_epoch(1)
    with pytest.raises(AttributeError, match=r"^'ShardedLoader' object has no attribute 'batch_size': it holds "
                                             r"global_batch_size, the batch of all ranks together"):
        loader.batch_size
    with pytest.raises(AttributeError, match=r"^'ShardedLoader' object has no attribute 'nonsense'$"):
        loader.nonsense
    assert not hasattr(loader, "set_epoch") and loader.global_batch_size == 4
    assert [size for _, size in copy.deepcopy(loader).epoch(0)] == [4, 2]  # copies still find nothing extra


def _foreign_order_calls(dp, optimizer, path):
    """Another tool's call made where phalanx's function stands, by the function's name."""
    return [("clip_grad_norm_", lambda: phalanx.clip_grad_norm_(dp, optimizer, max_norm=1.0),
             "DataParallel, SGD, max_norm="),
            ("clip_grad_norm_", lambda: phalanx.clip_grad_norm_(dp, optimizer, 1.0), "DataParallel, SGD, float"),
            ("clip_grad_norm_", lambda: phalanx.clip_grad_norm_(dp.parameters(), 1.0), "generator, float"),
            ("clip_grad_value_", lambda: phalanx.clip_grad_value_(dp, optimizer, clip_value=0.5),
             "DataParallel, SGD, clip_value="),
            ("checkpoint", lambda: phalanx.checkpoint(path, {"model": dp, "optimizer": optimizer}), "str, dict"),
            ("checkpoint", lambda: phalanx.checkpoint({"model": dp}, path), "dict, str"),
            ("resume", lambda: phalanx.resume(path, {"model": dp}), "str, dict")]


def test_another_tool_s_order_of_arguments_names_phalanx_s_way(tmp_path):
    # Fabric's clip_gradients(model, optimizer, max_norm=) and save(path, state) met Python's own
    # "got multiple values for argument 'max_norm'" / "takes 1 positional argument but 2 were given".
    with phalanx.prepare(nn.Linear(2, 2), world=WORLD1) as dp:
        optimizer = torch.optim.SGD(dp.parameters(), lr=0.1)
        for name, call, given in _foreign_order_calls(dp, optimizer, str(tmp_path / "ck")):
            with pytest.raises(TypeError) as info:
                call()
            assert str(info.value).startswith(f"{name}({given}) is another tool's order ("), str(info.value)
            whose, way = CALL_ORDERS[name]
            assert str(info.value) == f"{name}({given}) is another tool's order ({whose}): in phalanx, {way}"
        assert not (tmp_path / "ck").exists()
        dp.module(torch.ones(3, 2)).sum().backward()
        dp.finish_gradient_sync()
        assert phalanx.clip_grad_norm_(dp, 1e-3) > 1e-3  # phalanx's own order is as before
        assert phalanx.clip_grad_norm_(dp, max_norm=1e-3, norm_type=2.0) <= 1e-3 + 1e-6
        phalanx.checkpoint(tmp_path / "ck", world=WORLD1, model=dp, optimizer=optimizer, epoch=0,
                           global_batch_size=3, seed=0)
        assert phalanx.resume(tmp_path / "ck", world=WORLD1, model=dp, optimizer=optimizer, global_batch_size=3,
                              seed=0).epoch == 0
    for name in ("clip_grad_norm_", "clip_grad_value_", "checkpoint", "resume"):  # inspect sees the function's own
        assert "world" in str(inspect.signature(getattr(phalanx, name))) or name.startswith("clip")


def test_num_nodes_names_how_to_count_the_hosts():
    # Lightning's trainer.num_nodes (Fabric's strategy.num_nodes) asked of the World was Python's
    # bare "has no attribute": the way named counts the hosts as the allreduce's choice does.
    from phalanx.comm.hosts import host_counts
    with pytest.raises(AttributeError, match=r"^'World' object has no attribute 'num_nodes' \(Lightning's .*: in "
                                             r"phalanx, world.world_size // world.local_world_size hosts"):
        WORLD1.num_nodes
    two_hosts = World(rank=3, world_size=4, local_rank=1, local_world_size=2, device=torch.device("cpu"),
                      backend="gloo", timeout_s=5.0, node_rank=1)
    for world in (WORLD1, two_hosts):
        assert world.world_size // world.local_world_size == host_counts(world)[0]
