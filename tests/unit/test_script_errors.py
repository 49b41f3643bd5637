"""torch's own errors re-worded for a script under `phalanx run` (runtime/script_errors.py), each
made by torch itself in this process, not written by hand: a group opened with backend "nccl" for
CPU tensors (a CPU build refuses NCCL at init; where NCCL opens, its first collective on a CPU
tensor fails), and `init_process_group` a second time after phalanx.init(). Each is re-worded only
where it applies (CPU workers; after phalanx.init()), and a look-alike raised outside torch is not.
The SyncBatchNorm case runs end to end in tests/distributed/test_run_environment.py."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from phalanx.runtime.script_errors import GROUP_AFTER_INIT, NCCL_ON_CPU, reworded


@pytest.fixture
def no_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _caught(call) -> BaseException:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that NCCL is not compiled in
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - the exception is the result
            return exc
    raise AssertionError("torch raised nothing")


def _nccl_for_cpu_tensors() -> None:
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    dist.all_reduce(torch.ones(1))  # reached only where NCCL opened: a CPU tensor


def test_nccl_on_cpu_workers_is_named_with_gloo(no_group):
    exc = _caught(_nccl_for_cpu_tensors)
    assert reworded(exc, device_type="cpu", init_ran=False) == NCCL_ON_CPU, repr(exc)
    assert reworded(exc, device_type="cuda", init_ran=False) is None
    assert reworded(RuntimeError("Distributed package doesn't have NCCL built in"), device_type="cpu",
                    init_ran=False) is None  # not raised by torch


def test_a_second_group_after_phalanx_init_is_named(no_group):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    exc = _caught(lambda: dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1))
    assert reworded(exc, device_type="cpu", init_ran=True) == GROUP_AFTER_INIT
    assert reworded(exc, device_type="cpu", init_ran=False) is None  # the script's own two calls: torch's words


def test_only_gloos_own_timeout_is_reworded_as_the_timeout():
    from phalanx.runtime.script_errors import stalled

    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms "
                        "for recv operation to complete")
    assert stalled(gloo, timeout_s=20.0).startswith("a collective of the script's own process group waited 20 s")
    assert stalled(RuntimeError("Timed out waiting for my own queue"), timeout_s=20.0) is None  # the script's own
    assert stalled(ValueError(str(gloo)), timeout_s=20.0) is None
