"""Horovod's and DeepSpeed's habits on phalanx: a name asked of the phalanx module (`hvd.rank()`,
`deepspeed.initialize`), of the replica (DeepSpeed's engine: `engine.backward(loss)`), or a keyword
handed to prepare (`config=`, `compression=`) is one line naming phalanx's way, and every way
named exists."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from torch import nn

import phalanx
from phalanx.runtime.horovod_deepspeed import ENGINE_METHODS, KEYWORDS, MODULE_NAMES
from phalanx.runtime.world import World

WORLD1 = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), backend="none",
               timeout_s=5.0)


@pytest.mark.parametrize("name", sorted(MODULE_NAMES))
def test_a_horovod_or_deepspeed_name_asked_of_phalanx_names_phalanx_s_way(name):
    whose, way = MODULE_NAMES[name]
    with pytest.raises(AttributeError) as info:
        getattr(phalanx, name)
    assert str(info.value) == f"module 'phalanx' has no attribute {name!r} ({whose} name): in phalanx, {way}"
    assert "\n" not in str(info.value) and not hasattr(phalanx, name)


def test_a_horovod_name_imported_from_phalanx_names_phalanx_s_way_in_the_import_error():
    with pytest.raises(ImportError) as info:
        from phalanx import DistributedOptimizer  # noqa: F401
    whose, way = MODULE_NAMES["DistributedOptimizer"]
    assert str(info.value) == f"cannot import name 'DistributedOptimizer' from 'phalanx' ({whose} name): in phalanx, {way}"
    namespace: dict = {}
    with pytest.raises(ImportError, match=r"^cannot import name 'rank' from 'phalanx' \(Horovod's name\): in phalanx, "
                                          r"world = phalanx\.init\(\), then world\.rank$"):
        exec("from phalanx import init, rank", namespace)
    assert namespace["init"] is phalanx.init  # the names before it were imported, as Python does
    with pytest.raises(ImportError, match=r"^cannot import name 'nonsense' from 'phalanx'"):
        exec("from phalanx import nonsense", {})  # not another tool's: Python's own message


def test_other_missing_names_of_phalanx_keep_python_s_message_and_its_own_names_resolve():
    with pytest.raises(AttributeError, match=r"^module 'phalanx' has no attribute 'nonsense'$"):
        phalanx.nonsense
    for name in phalanx.__all__:  # the front door's names are never taken for another tool's
        assert name not in MODULE_NAMES and getattr(phalanx, name) is not None
    # phalanx's own where Horovod's has the same name: init, barrier, broadcast, allreduce
    assert {"init", "barrier", "broadcast", "allreduce"} <= set(phalanx.__all__)


@pytest.mark.parametrize("shard", ["none", "optimizer"])
@pytest.mark.parametrize("name", sorted(ENGINE_METHODS))
def test_a_deepspeed_engine_name_asked_of_the_replica_names_phalanx_s_way(name, shard):
    with phalanx.prepare(nn.Linear(2, 2), world=WORLD1, shard=shard) as dp:
        with pytest.raises(AttributeError) as info:
            getattr(dp, name)
        assert str(info.value) == (f"'{type(dp).__name__}' object has no attribute {name!r} (DeepSpeed engine's "
                                   f"name): in phalanx, {ENGINE_METHODS[name]}")
        assert "\n" not in str(info.value) and not hasattr(dp, name)
        assert dp.module.weight is dp.module.weight  # parameters and submodules as before


@pytest.mark.parametrize("keyword", sorted(KEYWORDS))
def test_a_deepspeed_or_horovod_keyword_handed_to_prepare_names_phalanx_s_way(keyword):
    whose, way = KEYWORDS[keyword]
    with pytest.raises(TypeError) as info:
        phalanx.prepare(nn.Linear(2, 2), world=WORLD1, **{keyword: None})
    assert str(info.value) == f"prepare() takes no {keyword}= ({whose} keyword): {way}"
    assert "\n" not in str(info.value)


def test_deepspeed_s_initialize_keywords_are_taken_or_named():
    """deepspeed.initialize's keywords (DeepSpeed 0.19.8, checked by hand; not installed here):
    `model=` is prepare's own, the rest is named."""
    taken = set(inspect.signature(phalanx.prepare).parameters)
    for keyword in ("args", "model", "optimizer", "model_parameters", "training_data", "lr_scheduler",
                    "distributed_port", "mpu", "dist_init_required", "collate_fn", "config", "mesh_param",
                    "config_params"):
        assert keyword in taken or keyword in KEYWORDS, keyword


def test_every_way_named_exists():
    ways = " ".join([*(way for _, way in MODULE_NAMES.values()), *ENGINE_METHODS.values(),
                     *(way for _, way in KEYWORDS.values())])
    for name in re.findall(r"phalanx\.(\w+)\(", ways):
        assert name in phalanx.__all__, name
    with phalanx.prepare(nn.Linear(2, 2), world=WORLD1) as dp:
        for name in re.findall(r"\bdp\.(\w+)", ways):
            assert hasattr(dp, name), name
        for name in re.findall(r"\bdp\.world\.(\w+)", ways):
            assert hasattr(dp.world, name), name
    for name in re.findall(r"\bworld\.(\w+)", ways):
        assert hasattr(WORLD1, name), name
    keywords = set(inspect.signature(phalanx.prepare).parameters)
    for name in re.findall(r"\b(\w+)=", " ".join(way for _, way in KEYWORDS.values())):
        assert name in keywords or name in {"global_batch_size", "collate_fn", "extras", "lr"}, name
    assert "grad_dtype='fp16' | 'bf16'" in ways
    for dtype in ("fp16", "bf16"):  # the wire dtypes named are prepare's
        with phalanx.prepare(nn.Linear(2, 2), world=WORLD1, grad_dtype=dtype):
            pass


def test_a_ds_config_s_zero_optimization_handed_to_prepare_names_shard_and_its_stages():
    with pytest.raises(TypeError) as info:
        phalanx.prepare(nn.Linear(2, 2), world=WORLD1, zero_optimization={"stage": 2})
    assert str(info.value) == ("prepare() takes no zero_optimization= (DeepSpeed config's keyword): shard= names "
                               "ZeRO's stage (stage 0 is 'none', 1 'optimizer', 2 'gradients', 3 'parameters')")


@pytest.mark.parametrize("shard, name", [(0, "none"), (1, "optimizer"), ("1", "optimizer"), (2, "gradients"),
                                         (3, "parameters"), ("zero3", "parameters")])
def test_a_zero_stage_number_as_shard_is_one_line_naming_phalanx_s_stage(shard, name):
    """Refused rather than taken: shard= has one spelling, the names saying what each rank keeps
    1/k of (the CLI's --shard too, which reads the same config)."""
    with pytest.raises(ValueError) as info:
        phalanx.prepare(nn.Linear(2, 2), world=WORLD1, shard=shard)
    stage = int(str(shard)[-1])
    assert str(info.value) == (f"shard {shard!r} is ZeRO's stage {stage}, which phalanx names {name!r} (stage 0 is "
                               "'none', 1 'optimizer', 2 'gradients', 3 'parameters': what each rank keeps 1/k of)")
    with pytest.raises(ValueError, match="shard True is unknown; choose one of none, optimizer"):
        phalanx.prepare(nn.Linear(2, 2), world=WORLD1, shard=True)
