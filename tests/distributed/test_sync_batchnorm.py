"""Synchronized BatchNorm on 2 and 3 gloo processes equals 1-device BatchNorm on the full batch.

One spawn per world size. The worker runs (a) single layers - BatchNorm2d (also channels_last)
and BatchNorm1d, float64 and float32, even / uneven / one-empty shards, two training steps then
eval - and returns its outputs, input gradients, local weight/bias gradients and running
statistics; the parent compares them with `nn.BatchNorm*` run on the whole batch in one process.
(b) The per-device policy on the same data, which must differ measurably (so the comparison can
fail), and `average_running_stats`. (c) DataParallel training steps of LeNet-BN and the small
ResNet with overlapped bucket allreduces (native on the default group, ring on AsyncComm's) and
with the layers' sums routed through the replica's shared-memory exchange (gloo's allreduce then
never called), compared with 1-device training. (d) Eval mode communicates nothing, and a SyncBatchNorm
collective paired with a foreign one is refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from phalanx.comm import AsyncComm, all_reduce_sum_
from phalanx.models import build_model
from phalanx.data_parallel import (DataParallel, DataParallelConfig, SyncBatchNorm, apply_memory_format,
                                   average_running_stats, convert_sync_batchnorm, sync_batchnorm)
from phalanx.train import train_batch
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

SPLITS = {  # shard sizes per rank: even, uneven, one rank with an empty shard
    2: {"even": [4, 4], "uneven": [7, 4], "empty": [0, 9]},
    3: {"even": [4, 4, 4], "uneven": [6, 3, 2], "empty": [5, 0, 4]},
}
LAYERS = {"2d": (nn.BatchNorm2d, (5, 6, 7)), "1d": (nn.BatchNorm1d, (4,)), "1d-seq": (nn.BatchNorm1d, (4, 3))}
DTYPES = {"float64": torch.float64, "float32": torch.float32}
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-5)}
STEPS = 2
TRAIN_TOL = {torch.float64: 1e-10, torch.float32: 1e-5}  # largest |difference| of any parameter or buffer
TRAIN = {  # name -> (model, dtype, DataParallel options, memory format, batchnorm policy)
    "native-overlap": ("lenet-bn", torch.float64, dict(allreduce="native", bucket_cap_mb=0.05), False, "sync"),
    "ring-overlap": ("lenet-bn", torch.float64, dict(allreduce="ring", bucket_cap_mb=0.05), False, "sync"),
    "native-sync-flat": ("lenet-bn", torch.float64, dict(overlap=False, bucket_cap_mb=None), False, "sync"),
    "float32-channels-last": ("lenet-bn", torch.float32, dict(allreduce="native"), True, "sync"),
    "resnet-native-overlap": ("resnet", torch.float64, dict(allreduce="native", bucket_cap_mb=0.25), False, "sync"),
    "local-native-overlap": ("lenet-bn", torch.float64, dict(allreduce="native", bucket_cap_mb=0.05), False, "local"),
    # the layers' sums through the replica's shared-memory exchange, queued behind the buckets in flight
    "shm-overlap": ("lenet-bn", torch.float64, dict(allreduce="shm", overlap=True, bucket_cap_mb=0.05), False, "sync"),
    "resnet-shm-sync": ("resnet", torch.float64, dict(allreduce="shm", overlap=False), False, "sync"),
}
TRAIN_SPLITS = {2: [[7, 6], [0, 5]], 3: [[5, 4, 4], [3, 0, 4]]}  # per step; step 2 has an empty shard


def _layer_data(layer: str, dtype, total: int, step: int):
    gen = torch.Generator().manual_seed(100 * step + len(layer))
    shape = (total,) + LAYERS[layer][1]
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 3 + 5
    g = torch.randn(shape, generator=gen, dtype=torch.float64)
    return x.to(dtype), g.to(dtype)


def _layer(layer: str, dtype) -> nn.Module:
    cls, shape = LAYERS[layer]
    bn = cls(shape[0]).to(dtype)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(3)
        bn.weight.copy_(torch.rand(shape[0], generator=gen) + 0.5)
        bn.bias.copy_(torch.randn(shape[0], generator=gen))
    return bn


def _rows(sizes: list[int], rank: int) -> slice:
    return slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))


def _run_layer(bn: nn.Module, layer: str, dtype, sizes: list[int], rows: slice, channels_last: bool = False):
    """Two training steps on `rows` of each step's batch, then eval; what each step produced."""
    steps = []
    for step in range(STEPS):
        x, g = _layer_data(layer, dtype, sum(sizes), step)
        x = x[rows]
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        x.requires_grad_()
        bn.zero_grad()
        y = bn(x)
        (y * g[rows]).sum().backward()
        steps.append((y.detach(), x.grad, bn.weight.grad.clone(), bn.bias.grad.clone()))
    bn.eval()
    x, _ = _layer_data(layer, dtype, sum(sizes), STEPS)
    evaluated = bn(x[rows]).detach()
    bn.train()
    return {"steps": steps, "eval": evaluated, "running": (bn.running_mean.clone(), bn.running_var.clone(),
                                                            bn.num_batches_tracked.clone())}


def _train_model(world, name: str):
    model_name, dtype, options, channels_last, policy = TRAIN[name]
    torch.manual_seed(5)
    model = build_model(model_name).to(dtype)
    if channels_last:
        apply_memory_format(model, torch.channels_last)
    if policy == "sync":
        model = convert_sync_batchnorm(model, world)
    return model, dtype, options


def _train_data(step: int, total: int, dtype):
    gen = torch.Generator().manual_seed(40 + step)
    images = torch.rand(total, 1, 28, 28, generator=gen, dtype=torch.float64).to(dtype)
    return images, torch.randint(0, 10, (total,), generator=gen)


class LoggingComm:
    """Records each bucket launch in a shared log (the SyncBatchNorm layers' backward hooks write there too)."""

    def __init__(self, comm: AsyncComm, log: list) -> None:
        self.comm, self.log = comm, log

    def allreduce_async(self, tensor, *, algorithm, **named):  # named: the tag (and on_done)
        self.log.append("bucket")
        return self.comm.allreduce_async(tensor, algorithm=algorithm, **named)

    def allreduce(self, tensor, *, algorithm, **named):  # the NaN/Inf check's sum (close() makes one): not logged
        return self.comm.allreduce(tensor, algorithm=algorithm, **named)


def _worker(world) -> dict:
    k, rank = world.world_size, world.rank
    out: dict = {}
    for dname, dtype in DTYPES.items():
        for layer in LAYERS:
            for split, sizes in SPLITS[k].items():
                rows = _rows(sizes, rank)
                for layout in (("contiguous", "channels_last") if layer == "2d" else ("contiguous",)):
                    bn = convert_sync_batchnorm(_layer(layer, dtype), world)
                    out[("sync", dname, layer, split, layout)] = _run_layer(bn, layer, dtype, sizes, rows,
                                                                            layout == "channels_last")
                if split == "uneven":  # the per-device policy on the same shards
                    bn = _layer(layer, dtype)
                    local = _run_layer(bn, layer, dtype, sizes, rows)
                    average_running_stats(bn, world=world)
                    local["averaged"] = (bn.running_mean.clone(), bn.running_var.clone(),
                                         bn.num_batches_tracked.clone())
                    out[("local", dname, layer, split)] = local
    # A private group instead of the default one gives the same numbers.
    group = dist.new_group(backend="gloo")
    bn = convert_sync_batchnorm(_layer("2d", torch.float64), world, group=group)
    out["group"] = _run_layer(bn, "2d", torch.float64, SPLITS[k]["uneven"], _rows(SPLITS[k]["uneven"], rank))

    # Eval communicates nothing: rank 0 alone runs three eval forwards, then everyone meets.
    if rank == 0:
        bn.eval()
        for _ in range(3):
            bn(torch.randn(3, 5, 6, 7, dtype=torch.float64))
    check = torch.ones(1, dtype=torch.float64)
    all_reduce_sum_(check, world=world)
    out["eval-silent"] = check.item()

    # A forward paired with a foreign collective of the same size is refused, not summed.
    bn = convert_sync_batchnorm(nn.BatchNorm1d(2), world)
    if rank == 0:
        try:
            bn(torch.randn(4, 2))
            out["mismatch"] = None
        except RuntimeError as exc:
            out["mismatch"] = str(exc)
    else:
        all_reduce_sum_(torch.full((6,), 7.0, dtype=torch.float64), world=world)

    for name in TRAIN:
        model, dtype, options = _train_model(world, name)
        log: list = []
        comm = AsyncComm(world=world) if name == "native-overlap" else None
        if comm is not None:  # record how bucket launches and the layers' backward collectives interleave
            for module in model.modules():
                if isinstance(module, SyncBatchNorm):
                    module.register_full_backward_hook(lambda *_: log.append("bn"))
            dp = DataParallel.over(LoggingComm(comm, log), model, world=world, options=DataParallelConfig(**options))
        else:
            dp = DataParallel(model, world=world, options=DataParallelConfig(**options))
        backend_sum = sync_batchnorm.allreduce_native
        if name.startswith(("shm", "resnet-shm")):  # routed through the replica's exchange: gloo's never called
            sync_batchnorm.allreduce_native = lambda *args, **kwargs: (_ for _ in ()).throw(
                AssertionError("SyncBatchNorm summed with gloo's allreduce"))
        optimizer = torch.optim.SGD(dp.module.parameters(), lr=0.1)
        for step, sizes in enumerate(TRAIN_SPLITS[k]):
            X, y = _train_data(step, sum(sizes), dtype)
            rows = _rows(sizes, rank)
            if min(sizes) > 0:  # the production step (train_batch skips empty pieces)
                train_batch(dp, optimizer, X[rows], y[rows], global_batch_size=sum(sizes))
            else:  # with SyncBatchNorm an empty shard must still run forward and backward
                dp.zero_grad()
                (F.cross_entropy(dp(X[rows]), y[rows], reduction="sum") / sum(sizes)).backward()
                dp.finish_gradient_sync()
                optimizer.step()
        if TRAIN[name][4] == "local":  # what the trainer does before evaluating
            average_running_stats(dp.module, world=world)
        sync_batchnorm.allreduce_native = backend_sum
        out[("train", name)] = {k_: v.detach().clone() for k_, v in dp.module.state_dict().items()}
        out[("order", name)] = (log, len(dp.buckets))
        dp.close()
        if comm is not None:
            comm.close()
    return out


def _reference_layer(layer, dtype, sizes):
    bn = _layer(layer, dtype)
    return _run_layer(bn, layer, dtype, sizes, slice(0, sum(sizes)))


def _reference_train(name: str, k: int) -> dict:
    model_name, dtype, _, channels_last, _ = TRAIN[name]
    torch.manual_seed(5)
    model = build_model(model_name).to(dtype)
    if channels_last:
        apply_memory_format(model, torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, sizes in enumerate(TRAIN_SPLITS[k]):
        X, y = _train_data(step, sum(sizes), dtype)
        optimizer.zero_grad()
        (F.cross_entropy(model(X), y, reduction="sum") / sum(sizes)).backward()
        optimizer.step()
    return model.state_dict()


@pytest.fixture(scope="module", params=[2, 3], ids=lambda k: f"{k}procs")
def run(request):
    return request.param, run_workers(_worker, request.param, timeout_s=240)


def _assert_layer_matches(results, key, sizes, ref, tol):
    for step, (y_ref, gx_ref, gw_ref, gb_ref) in enumerate(ref["steps"]):
        ys, gxs, gws, gbs = zip(*(r[key]["steps"][step] for r in results))
        torch.testing.assert_close(torch.cat(ys), y_ref, **tol, msg=lambda m: f"{key} step {step} output: {m}")
        torch.testing.assert_close(torch.cat(gxs), gx_ref, **tol, msg=lambda m: f"{key} step {step} dx: {m}")
        # weight/bias gradients are local sums; DataParallel adds them up across ranks
        torch.testing.assert_close(sum(gws), gw_ref, **tol, msg=lambda m: f"{key} step {step} dw: {m}")
        torch.testing.assert_close(sum(gbs), gb_ref, **tol, msg=lambda m: f"{key} step {step} db: {m}")
    torch.testing.assert_close(torch.cat([r[key]["eval"] for r in results]), ref["eval"], **tol)
    for r in results:
        for mine, theirs, expected in zip(r[key]["running"], results[0][key]["running"], ref["running"]):
            assert torch.equal(mine, theirs), f"{key}: running statistics differ between ranks"
            torch.testing.assert_close(mine, expected, **tol)


def test_sync_layers_equal_one_device_full_batch(run):
    k, results = run
    checked = 0
    for key in results[0]:
        if isinstance(key, tuple) and key[0] == "sync":
            _, dname, layer, split, _ = key
            dtype = DTYPES[dname]
            _assert_layer_matches(results, key, SPLITS[k][split], _reference_layer(layer, dtype, SPLITS[k][split]),
                                  TOL[dtype])
            checked += 1
    assert checked == len(DTYPES) * (len(LAYERS) + 1) * len(SPLITS[k])
    empty_rank = SPLITS[k]["empty"].index(0)
    assert results[empty_rank][("sync", "float64", "2d", "empty", "contiguous")]["steps"][0][0].shape[0] == 0
    _assert_layer_matches(results, "group", SPLITS[k]["uneven"],
                          _reference_layer("2d", torch.float64, SPLITS[k]["uneven"]), TOL[torch.float64])


def test_local_policy_differs_and_averaging_reunites_replicas(run):
    k, results = run
    for dname, dtype in DTYPES.items():
        for layer in LAYERS:
            key = ("local", dname, layer, "uneven")
            ref = _reference_layer(layer, dtype, SPLITS[k]["uneven"])
            with pytest.raises(AssertionError):  # proves the sync comparison above can fail
                _assert_layer_matches(results, key, SPLITS[k]["uneven"], ref, TOL[dtype])
            y_local = torch.cat([r[key]["steps"][0][0] for r in results])
            assert (y_local - ref["steps"][0][0]).abs().max() > 1e-2
            means = [r[key]["running"][0] for r in results]
            assert (means[0] - means[1]).abs().max() > 1e-3, "per-device running means should diverge"
            for r in results:
                for i in range(2):
                    assert torch.equal(r[key]["averaged"][i], results[0][key]["averaged"][i])
                    torch.testing.assert_close(r[key]["averaged"][i], sum(s[key]["running"][i] for s in results) / k,
                                               **TOL[dtype])


def test_eval_is_silent_and_mismatch_is_refused(run):
    k, results = run
    assert results[0]["eval-silent"] == k
    assert results[0]["mismatch"] is not None and "paired with a different collective" in results[0]["mismatch"]


def test_data_parallel_training_with_sync_batchnorm_equals_one_device(run):
    k, results = run
    for name, (_, dtype, _, _, policy) in TRAIN.items():
        expected = _reference_train(name, k)
        for r in results:
            state = r[("train", name)]
            assert state.keys() == expected.keys(), name
            for key, value in state.items():
                assert torch.equal(value, results[0][("train", name)][key]), f"{name} {key}: replicas differ"
        mine = results[0][("train", name)]
        diff = max((mine[key].double() - expected[key].double()).abs().max().item() for key in expected)
        if policy == "sync":
            assert diff < TRAIN_TOL[dtype], f"{name}: largest difference from 1 device {diff:.2e}"
        else:  # per-device statistics: a different model (the test above could fail)
            assert diff > 1e-4, f"{name}: the local policy should differ from 1 device, got {diff:.2e}"


def test_bucket_launches_interleave_with_batchnorm_backward(run):
    """The hazard the ordering contract covers really occurs: buckets go out on the default group
    between the layers' synchronous backward collectives, and training still matches (above)."""
    _, results = run
    log, num_buckets = results[0][("order", "native-overlap")]
    assert num_buckets > 1
    assert log.count("bn") == 3 * len(TRAIN_SPLITS[2]) and log.count("bucket") == num_buckets * len(TRAIN_SPLITS[2])
    first_step = log[: len(log) // 2]
    assert first_step.index("bucket") < len(first_step) - 1 - first_step[::-1].index("bn"), first_step
    assert all(r[("order", "native-overlap")][0] == log for r in results)  # the same sequence on every rank
