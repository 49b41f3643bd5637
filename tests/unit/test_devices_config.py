"""Device specs and the training config: every bad value is refused with its number and a fix."""

import pytest

from phalanx.runtime.devices import parse_devices
from phalanx.errors import UsageError
from phalanx.data.config import DataConfig
from phalanx.data_parallel.config import DataParallelConfig
from phalanx.job.config import TrainConfig
from phalanx.job.optim import OptimizerConfig
from phalanx.models import build_model, has_batchnorm
from phalanx.runtime.launch_config import LaunchConfig


def test_plain_count_uses_cpu_without_cuda():
    plan = parse_devices("3", cuda_count=0)
    assert plan.names == ("cpu:0", "cpu:1", "cpu:2")
    assert plan.kind == "cpu" and plan.num_devices == 3
    assert str(plan) == "[cpu:0, cpu:1, cpu:2]"


def test_plain_count_uses_gpus_when_present():
    assert parse_devices("2", cuda_count=4).names == ("cuda:0", "cuda:1")


def test_explicit_forms():
    assert parse_devices("cpu:4", cuda_count=8).names == tuple(f"cpu:{i}" for i in range(4))
    assert parse_devices("cuda:1,3", cuda_count=4).names == ("cuda:1", "cuda:3")


@pytest.mark.parametrize(
    "spec, cuda_count, fragment",
    [
        ("0", 0, "no device"),
        ("4", 2, "2 are present"),
        ("cuda:0,1", 0, "0 GPUs are present"),
        ("cuda:0,5", 2, "GPU 5"),
        ("cuda:1,1", 2, "repeats"),
        ("cpu:0", 0, "cpu:N"),
        ("cpu:x", 0, "cpu:N"),
        ("tpu:2", 0, "not understood"),
    ],
)
def test_bad_device_specs(spec, cuda_count, fragment):
    with pytest.raises(UsageError, match=fragment) as info:
        parse_devices(spec, cuda_count=cuda_count)
    assert "\n" not in str(info.value)


def test_config_defaults_are_the_books():
    config = TrainConfig()
    assert (config.epochs, config.global_batch_size, config.optim.lr, config.model) == (10, 256, 0.2, "lenet")


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"epochs": 0}, "--epochs 0"),
        ({"optim": lambda: OptimizerConfig(lr=0.0)}, "--lr 0.0"),
        ({"optim": lambda: OptimizerConfig(lr=-1.0)}, "--lr -1.0"),
        ({"optim": lambda: OptimizerConfig(lr=float("nan"))}, "--lr nan"),
        ({"global_batch_size": 0}, "--batch-size 0"),
        ({"data_parallel": lambda: DataParallelConfig(allreduce="magic")}, "ring"),
        ({"model": "vgg"}, "lenet"),
        ({"data": lambda: DataConfig(dataset="cifar")}, "fashion-mnist"),
        ({"init": "xavier"}, "book"),
        ({"launch": lambda: LaunchConfig(threads_per_device=0)}, "threads"),
        ({"launch": lambda: LaunchConfig(timeout_s=0)}, "timeout"),
    ],
)
def test_config_rejects_bad_values(kwargs, fragment):
    # A component's value is made inside pytest.raises: each config checks itself on construction.
    with pytest.raises(ValueError, match=fragment):
        TrainConfig(**{key: value() if callable(value) else value for key, value in kwargs.items()})


def test_batch_smaller_than_device_count():
    with pytest.raises(ValueError, match="smaller than the 4 devices"):
        TrainConfig(global_batch_size=3).check_devices(4)
    TrainConfig(global_batch_size=4).check_devices(4)


@pytest.mark.parametrize("kwargs, num_train, devices, fragment", [
    # the epoch's last batch of 1 (149 = 4 x 37 + 1): torch's "Expected more than 1 value per channel"
    # at the end of the first epoch before, with a traceback
    (dict(global_batch_size=37), 149, 1, "last batch (149 = 4 x 37 + 1) leaves one of 1 example: use --train-examples 148"),
    (dict(global_batch_size=37), 149, 2, "leaves one of 1 example: use --train-examples 148 (whole batches)"),
    # a last batch of 2 in 3 micro-batches: one empty ("got 0" from SyncBatchNorm on 3 workers)
    (dict(global_batch_size=37, data_parallel=DataParallelConfig(grad_accum_steps=3)), 150, 3,
     "micro-batches leaves one of 0 examples: use --train-examples 148 (whole batches), or a smaller --grad-accum"),
    (dict(global_batch_size=3, data_parallel=DataParallelConfig(grad_accum_steps=2)), 150, 1,
     "a batch of 3 in --grad-accum 2 micro-batches leaves one of 1 example: use --batch-size 4 or more"),
    (dict(global_batch_size=3, data_parallel=DataParallelConfig(batchnorm="local")), 150, 2,
     "each device's share of a batch by its own statistics, which takes 2 or more examples, and a batch of 3 on 2 "
     "devices (--batchnorm local) leaves one of 1 example: use --batch-size 4 or more"),
])
def test_a_batchnorm_micro_batch_of_fewer_than_two_examples_is_refused_before_training(kwargs, num_train, devices,
                                                                                      fragment):
    with pytest.raises(ValueError, match="^--model lenet-bn normalizes each ") as refused:
        TrainConfig(model="lenet-bn", **kwargs).check_batch_statistics(num_train, devices, batchnorm=True)
    assert fragment in str(refused.value)


@pytest.mark.parametrize("kwargs, num_train, devices", [
    (dict(model="lenet-bn", global_batch_size=37), 150, 3),  # a last batch of 2, over the global batch (sync)
    (dict(model="lenet-bn", global_batch_size=3), 150, 2),  # a share of 1, the statistics over the global 3
    (dict(model="lenet", global_batch_size=37), 149, 2),  # no BatchNorm: a batch of 1 is fine
    (dict(model="lenet-bn", global_batch_size=37, data_parallel=DataParallelConfig(grad_accum_steps=2)), 148, 2),
])
def test_batchnorm_batches_of_two_or_more_and_models_without_batchnorm_pass(kwargs, num_train, devices):
    config = TrainConfig(**kwargs)
    config.check_batch_statistics(num_train, devices, batchnorm=has_batchnorm(build_model(config.model)))
