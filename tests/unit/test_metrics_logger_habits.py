"""`phalanx.MetricsLogger` as a Fabric script ported by docs/accelerate-fabric.md's table uses it:
a one-element tensor (a loss) is logged as its number, Fabric's `log(name, value)` and `log_dict`
are one line naming `log(row)` on every rank, and a value JSON cannot write is refused before it
reaches the file (before 2026-12-03 a tensor stayed in the rows after json's TypeError, so every
later `log` failed too)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import phalanx
from phalanx.runtime.world import World


def _world(rank: int = 0) -> World:
    return World(rank=rank, world_size=2, local_rank=rank, local_world_size=2, device=torch.device("cpu"),
                 backend="gloo", timeout_s=5.0)


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_a_one_element_tensor_or_numpy_value_is_logged_as_its_number(tmp_path):
    with phalanx.MetricsLogger(tmp_path, world=_world(), tensorboard=False) as logger:
        logger.log({"epoch": 1, "loss": torch.tensor(0.25, dtype=torch.float64), "acc": np.float32(0.5),
                    "seen": torch.tensor([7])})
    assert _rows(tmp_path) == [{"epoch": 1, "loss": 0.25, "acc": 0.5, "seen": 7}]


@pytest.mark.parametrize("rank", [0, 1])
def test_fabric_s_log_name_value_is_one_line_on_every_rank(tmp_path, rank):
    logger = phalanx.MetricsLogger(tmp_path, world=_world(rank), tensorboard=False)
    with pytest.raises(TypeError) as info:
        logger.log("loss", 0.5, step=3)
    assert str(info.value) == ("MetricsLogger.log takes one row, a dict: logger.log({'loss': value}, step=step) for "
                               "Fabric's fabric.log(name, value, step=step)")
    for name in ("log_dict", "log_metrics"):
        with pytest.raises(AttributeError, match=rf"^'MetricsLogger' object has no attribute '{name}' \(Fabric's "
                                                 r"name\): in phalanx, logger.log\(row, step=step\)"):
            getattr(logger, name)
    with pytest.raises(TypeError, match=r"row\['h'\] is a Tensor of 3 values; log numbers"):
        logger.log({"h": torch.zeros(3)})


def test_a_value_json_cannot_write_is_refused_and_the_logger_goes_on(tmp_path):
    with phalanx.MetricsLogger(tmp_path, world=_world(), tensorboard=False) as logger:
        with pytest.raises(TypeError, match=r"^MetricsLogger.log: the row cannot be written as JSON .*; log numbers"):
            logger.log({"epoch": 1, "when": object()})
        logger.log({"epoch": 1, "loss": 0.5})
    assert _rows(tmp_path) == [{"epoch": 1, "loss": 0.5}]
