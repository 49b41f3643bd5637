"""The way to run k ranks on one GPU (PHALANX_RANKS_SHARE_GPU, documented in docs/command.md), the
parts a CPU can check: runtime/world.py reads the switch (and nothing else does), and the one algorithm family gloo cannot carry with
CUDA tensors is refused before any device or collective is touched. tests/gpu runs the mode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from phalanx.errors import UsageError
from phalanx.models import LeNet
from phalanx.data_parallel import DataParallel, DataParallelConfig
from phalanx.runtime.world import RANKS_SHARE_GPU_VAR, World, ranks_share_gpu

PACKAGE = Path(__file__).resolve().parents[2] / "phalanx"


def test_the_switch_is_off_unless_set_to_one():
    assert ranks_share_gpu({}) is False
    assert ranks_share_gpu({RANKS_SHARE_GPU_VAR: "0"}) is False
    assert ranks_share_gpu({RANKS_SHARE_GPU_VAR: "1"}) is True
    with pytest.raises(UsageError, match=f"{RANKS_SHARE_GPU_VAR}='yes' is not understood; set it to 1"):
        ranks_share_gpu({RANKS_SHARE_GPU_VAR: "yes"})


def test_world_py_is_the_only_reader_of_the_switch():
    readers = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
               if "PHALANX_RANKS_SHARE_GPU" in p.read_text()]
    assert readers == ["runtime/world.py"]


@pytest.mark.parametrize("algorithm", ["ring", "tree", "naive"])
def test_point_to_point_algorithms_are_refused_for_cuda_tensors_over_gloo(algorithm):
    # Refused before the module moves to the device: this runs without a GPU.
    world = World(rank=0, world_size=2, local_rank=0, local_world_size=2, device=torch.device("cuda", 0),
                  backend="gloo", timeout_s=10.0)
    refusal = f"allreduce '{algorithm}' sends CUDA tensors point to point, which gloo cannot"
    with pytest.raises(ValueError, match=refusal):
        DataParallel(LeNet(), world=world, options=DataParallelConfig(allreduce=algorithm))
