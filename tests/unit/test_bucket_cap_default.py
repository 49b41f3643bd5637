"""The bucket cap's default depends on the allreduce that carries the buckets, and a cap given wins.

`bucket_cap_mb="auto"` (the default of prepare, DataParallelConfig, `--bucket-cap-mb`) is 0.25 MB
for the shm allreduce and 25 MB (DDP's, first bucket 1 MiB) for native gloo/NCCL, whose every call
pays a fixed cost; the run's first line names the cap. A world of one exchanging alone builds the
k-device replica's buckets, so no processes are needed.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from phalanx.cli import build_parser
from phalanx.data_parallel import DataParallel, DataParallelConfig
from phalanx.job.config import TrainConfig
from phalanx.options import build
from phalanx.predict.config import PredictConfig
from phalanx.runtime.world import World

WORLD1 = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
               backend="none", timeout_s=10.0)


def _mlp() -> nn.Module:
    # 8 x (256 KB weight + 1 KB bias) = 2 MB: 16 buckets at 0.25 MB, 2 at 25 MB (the first 1 MiB).
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])


def _buckets(**options) -> tuple[int, str]:
    config = DataParallelConfig(exchange_alone=True, overlap=True, **options)
    with DataParallel(_mlp(), world=WORLD1, options=config) as dp:
        return len(dp.buckets), dp.choices.describe()


def test_the_default_cap_is_the_allreduces_own():
    count, line = _buckets(allreduce="native")
    assert count == 2 and "(cap 25 MB, auto for native)" in line, line
    count, line = _buckets(allreduce="shm")
    assert count == 16 and "(cap 0.25 MB, auto for shm)" in line, line


@pytest.mark.parametrize("allreduce", ["native", "shm"])
def test_a_cap_given_wins_over_the_default(allreduce):
    count, line = _buckets(allreduce=allreduce, bucket_cap_mb=0.25)
    assert count == 16 and line.count("(cap 0.25 MB)") == 1, line
    count, line = _buckets(allreduce=allreduce, bucket_cap_mb=25)
    assert count == 2 and "(cap 25 MB)" in line, line
    count, line = _buckets(allreduce=allreduce, bucket_cap_mb=None)  # one bucket, no cap named
    assert count == 1 and "cap" not in line, line


def test_the_flag_keeps_auto_until_the_allreduce_is_known_and_a_number_given_wins():
    parse = build_parser().parse_args
    assert build(TrainConfig, parse(["train", "--allreduce", "native"])).data_parallel.bucket_cap_mb == "auto"
    given = build(TrainConfig, parse(["train", "--allreduce", "native", "--bucket-cap-mb", "0.25"]))
    assert given.data_parallel.bucket_cap_mb == 0.25
    assert build(TrainConfig, parse(["train", "--bucket-cap-mb", "auto"])).data_parallel.bucket_cap_mb == "auto"
    with pytest.raises(ValueError, match=r"--bucket-cap-mb x must be a positive number of MB, 'auto', or none"):
        DataParallelConfig(bucket_cap_mb="x")


def test_predict_resolves_auto_as_training_would():
    assert PredictConfig(algorithm="native").bucket_cap_mb == 25
    assert PredictConfig(algorithm="shm").bucket_cap_mb == 0.25
    assert PredictConfig(algorithm="native", bucket_cap_mb=1.0).bucket_cap_mb == 1.0
