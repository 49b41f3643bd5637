"""The multi-process CUDA path on a machine with one GPU: two ranks share cuda:0 and
talk over gloo (PHALANX_RANKS_SHARE_GPU, read in runtime/world.py), so broadcast,
bucketed and overlapped gradient exchange (hooks on autograd's CUDA thread, a side stream
included), evaluation, training, sync BatchNorm, checkpoint/resume and `phalanx verify` all run
with CUDA tensors in 2 processes, and must equal 1 device (float64, 1e-9 relative: cuDNN and
cuBLAS may sum a shard in another order than the whole batch). NCCL itself is not exercised here
(it refuses two ranks on one GPU); tests/gpu/test_cuda.py runs it where 2 GPUs are present.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from phalanx.data import load_synthetic_dataset, rank_shard
from phalanx.runtime.devices import DevicePlan
from phalanx.runtime.launch import LaunchSpec, WorkerFailed, launch
from phalanx.models import LeNet, build_model
from phalanx.data_parallel import DataParallel
from phalanx.data.config import DataConfig
from phalanx.data_parallel.config import DataParallelConfig
from phalanx.job.checkpointing import CheckpointConfig
from phalanx.job.optim import OptimizerConfig
from phalanx.job.config import TrainConfig
from phalanx.train import train_batch
from phalanx.train.evaluate import evaluate
from phalanx.job.job import train_worker
from phalanx.verify import VerifyConfig, verify
from phalanx.runtime.world import RANKS_SHARE_GPU_VAR, World

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SHARED = DevicePlan(names=("cuda:0", "cuda:0"))
ONE = DevicePlan(names=("cuda:0",))
TOL = dict(rtol=1e-9, atol=1e-12)
BATCH_SIZES = (37, 37, 21)  # uneven over 2 ranks (19 + 18, 11 + 10)
# The overlapped variants name shm's 0.25 MB cap: LeNet in 3 buckets (NCCL's own, 25 MB, takes it whole).
STEP_VARIANTS = {"overlap": dict(overlap=True, bucket_cap_mb=0.25),
                 "synchronous": dict(overlap=False, bucket_cap_mb=None),
                 "overlap on a side stream": dict(overlap=True, bucket_cap_mb=0.25)}


@pytest.fixture(scope="module", autouse=True)
def ranks_share_the_gpu():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(RANKS_SHARE_GPU_VAR, "1")  # spawned workers inherit it
        yield


def _launch(fn, *args, plan: DevicePlan = SHARED):
    return launch(fn, *args, spec=LaunchSpec(plan=plan, timeout_s=60.0, deadline_s=300.0))


def _data(device: torch.device):
    gen = torch.Generator().manual_seed(7)
    X = torch.rand(sum(BATCH_SIZES), 1, 28, 28, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 10, (sum(BATCH_SIZES),), generator=gen)
    return X.to(device), y.to(device)


def _cpu(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}


def collectives_worker(world: World) -> dict:
    """Broadcast, three steps per exchange variant, and evaluation, on this rank's CUDA tensors."""
    out = {"backend": world.backend, "device": str(world.device)}
    torch.manual_seed(100 + world.rank)  # different on each rank: the broadcast must fix that
    # (No overlap here: closing a replica right after construction can tear down its private gloo
    # group while the peer is still connecting to it.)
    with DataParallel(LeNet().double(), world=world, options=DataParallelConfig(overlap=False)) as dp:
        out["broadcast"] = _cpu(dp.module)
    X, y = _data(world.device)
    for name, options in STEP_VARIANTS.items():
        torch.manual_seed(0)
        with DataParallel(LeNet().double(), world=world, options=DataParallelConfig(**options)) as dp:
            optimizer = torch.optim.SGD(dp.module.parameters(), lr=0.1)
            stream = torch.cuda.Stream() if "side stream" in name else torch.cuda.current_stream()
            with torch.cuda.stream(stream):
                start = 0
                for size in BATCH_SIZES:
                    shard = rank_shard(torch.arange(start, start + size, device=world.device), rank=world.rank,
                                       world_size=world.world_size)
                    train_batch(dp, optimizer, X[shard], y[shard], global_batch_size=size)
                    start += size
            torch.cuda.current_stream().wait_stream(stream)
            out[name] = (len(dp.buckets), _cpu(dp.module))
            images = torch.randint(0, 256, (101, 1, 28, 28), dtype=torch.uint8,
                                   generator=torch.Generator().manual_seed(1)).to(world.device)
            labels = torch.randint(0, 10, (101,), generator=torch.Generator().manual_seed(2)).to(world.device)
            out[f"{name} accuracy"] = evaluate(dp.module, images, labels, world=world, batch_size=16)
    return out


@pytest.fixture(scope="module")
def collectives():
    return _launch(collectives_worker)


def test_two_ranks_share_cuda_0_over_gloo_and_start_from_rank_0s_weights(collectives):
    assert [(r["backend"], r["device"]) for r in collectives] == [("gloo", "cuda:0")] * 2
    torch.manual_seed(100)
    expected = _cpu(LeNet().double())
    for result in collectives:
        for key, value in expected.items():
            assert torch.equal(result["broadcast"][key], value), key


@pytest.mark.parametrize("variant", sorted(STEP_VARIANTS))
def test_exchanged_steps_on_cuda_equal_one_device(collectives, variant):
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    reference = LeNet().double().to(device)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    X, y = _data(device)
    start = 0
    for size in BATCH_SIZES:
        optimizer.zero_grad()
        (F.cross_entropy(reference(X[start:start + size]), y[start:start + size], reduction="sum") / size).backward()
        optimizer.step()
        start += size
    for rank, result in enumerate(collectives):
        num_buckets, state = result[variant]
        assert num_buckets == (3 if STEP_VARIANTS[variant]["overlap"] else 1)
        for key, value in _cpu(reference).items():
            torch.testing.assert_close(state[key], value, **TOL, msg=lambda m, key=key: f"rank {rank} {key}: {m}")


def test_evaluation_on_two_ranks_counts_every_image_once(collectives):
    for variant in STEP_VARIANTS:
        accuracies = {r[f"{variant} accuracy"] for r in collectives}
        assert len(accuracies) == 1  # every rank sees the summed counts
        assert 0.0 <= accuracies.pop() <= 1.0
    # The same weights give the same accuracy on one device (101 images: shards of 51 and 50).
    device = torch.device("cuda", 0)
    model = LeNet().double().to(device)
    model.load_state_dict(collectives[0]["overlap"][1])
    images = torch.randint(0, 256, (101, 1, 28, 28), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(1)).to(device)
    labels = torch.randint(0, 10, (101,), generator=torch.Generator().manual_seed(2)).to(device)
    one = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=device, backend="none", timeout_s=30.0)
    assert evaluate(model, images, labels, world=one, batch_size=16) == collectives[0]["overlap accuracy"]


def _train(tmp_path, config: TrainConfig, plan: DevicePlan, name: str) -> tuple[dict, list]:
    out = tmp_path / name
    results = _launch(train_worker, replace(config, out_dir=str(out)), plan.names, plan=plan)
    return torch.load(out / "model.pt", weights_only=True), results


@pytest.fixture(scope="module")
def base_config(idx_dir):
    return TrainConfig(data=DataConfig(dataset="fashion-mnist", directory=str(idx_dir)), epochs=2, global_batch_size=256,
                       optim=OptimizerConfig(lr=0.2),
                       seed=3, progress=False, dtype="float64")


@pytest.fixture(scope="module")
def two_ranks_lenet(tmp_path_factory, base_config):
    """2 epochs of the sample on 2 ranks sharing the GPU, checkpointing every epoch."""
    tmp = tmp_path_factory.mktemp("lenet")
    return _train(tmp, replace(base_config, checkpoint=CheckpointConfig(every="epoch", directory=str(tmp / "checkpoints"))),
                  SHARED, "two")


def _assert_same_model(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], **TOL, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("model", ["lenet", "lenet-bn"])
def test_two_epochs_on_two_ranks_equal_one_gpu(tmp_path, base_config, two_ranks_lenet, model):
    """LeNet, and LeNet-BN with sync BatchNorm (BatchNorm1d included) on CUDA tensors; 3,000
    images in batches of 256 end every epoch with a batch of 184."""
    config = replace(base_config, model=model)
    state, results = two_ranks_lenet if model == "lenet" else _train(tmp_path, config, SHARED, "two")
    reference, reference_results = _train(tmp_path, config, ONE, "one")
    _assert_same_model(state, reference)
    rows, ref_rows = results[0]["history"], reference_results[0]["history"]
    assert [r["devices"] for r in rows] == [["cuda:0", "cuda:0"]] * 2
    for row, ref in zip(rows, ref_rows):
        assert row["train_loss"] == pytest.approx(ref["train_loss"], rel=1e-9)
        assert row["test_acc"] == ref["test_acc"]


def test_resume_on_two_ranks_ends_where_the_uninterrupted_run_does(tmp_path, base_config, two_ranks_lenet):
    reference, _ = two_ranks_lenet
    checkpoints = str(tmp_path / "checkpoints")
    first = replace(base_config, epochs=1, checkpoint=CheckpointConfig(every="epoch", directory=checkpoints))
    _train(tmp_path, first, SHARED, "first")
    state, results = _train(tmp_path, replace(first, epochs=2, checkpoint=replace(first.checkpoint, resume=checkpoints)), SHARED, "resumed")
    assert [r["epoch"] for r in results[0]["history"]] == [2]  # only the epoch left was trained
    _assert_same_model(state, reference)


def test_verify_passes_with_cuda_tensors_in_two_processes():
    data = load_synthetic_dataset((160, 1))
    config = VerifyConfig(device="cuda", world_sizes=(2,), steps=3, global_batch_size=31, timeout_s=60.0,
                          deadline_s=300.0)
    report = verify(functools.partial(build_model, "lenet-bn"), (data.train_images, data.train_labels), config=config)
    assert report.passed, report.render()
    comparison = report.result(2).comparison
    assert len(comparison.steps) == 3 and comparison.max_rel < 1e-9


def test_point_to_point_allreduce_is_refused_with_cuda_tensors_over_gloo(tmp_path, base_config):
    with pytest.raises(WorkerFailed, match="allreduce 'ring' sends CUDA tensors point to point, which gloo cannot"):
        _train(tmp_path, replace(base_config, epochs=1, data_parallel=DataParallelConfig(allreduce="ring")), SHARED, "ring")


def gather_worker(world: World) -> dict:
    """phalanx.gather and barrier with CUDA tensors: uneven shards, a bool, a 0-d."""
    import phalanx

    rows = torch.arange(3 * (world.rank + 1), dtype=torch.float64, device=world.device).reshape(-1, 3) + world.rank
    flags = torch.tensor([True, world.rank == 1], device=world.device)
    out = {"rows": phalanx.gather(rows, world=world), "flags": phalanx.gather(flags, world=world),
           "scalar": phalanx.gather(torch.tensor(float(world.rank), device=world.device), world=world)}
    phalanx.barrier(world=world)
    return {name: (value.device.type, value.cpu()) for name, value in out.items()}


def test_gather_and_barrier_take_cuda_tensors():
    expected = {"rows": torch.cat([torch.arange(3.0, dtype=torch.float64).reshape(1, 3),
                                   torch.arange(6.0, dtype=torch.float64).reshape(2, 3) + 1]),
                "flags": torch.tensor([True, False, True, True]), "scalar": torch.tensor([0.0, 1.0])}
    for result in _launch(gather_worker):
        for name, want in expected.items():
            device_type, got = result[name]
            assert device_type == "cuda" and torch.equal(got, want), name


def unused_worker(world: World) -> dict:
    """Usage flags and a layout laid out again with CUDA buckets: a head no rank uses on every other
    step (its gradient None, AdamW skips it), a trunk frozen at prepare and unfrozen at step 2."""
    import phalanx

    def model():
        torch.manual_seed(0)
        net = torch.nn.ModuleDict({"trunk": torch.nn.Linear(4, 8), "a": torch.nn.Linear(8, 3),
                                   "b": torch.nn.Linear(8, 3)}).double().to(world.device)
        net["trunk"].requires_grad_(False)
        return net

    def forward(net, x, step):
        h = torch.tanh(net["trunk"](x))
        return net["a"](h) if step % 2 == 0 else net["b"](h)

    gen = torch.Generator().manual_seed(5)
    batches = [(torch.randn(10, 4, generator=gen, dtype=torch.float64).to(world.device),
                torch.randint(0, 3, (10,), generator=gen).to(world.device)) for _ in range(5)]
    out = {}
    for overlap in (True, False):
        dp = phalanx.prepare(model(), world=world, overlap=overlap)
        optimizer = torch.optim.AdamW(dp.parameters(), lr=0.05, weight_decay=0.1)
        for step, (X, y) in enumerate(batches):
            if step == 2:
                dp.module["trunk"].requires_grad_(True)
            rows = rank_shard(torch.arange(10), rank=world.rank, world_size=world.world_size)
            dp.zero_grad()
            loss_sum = F.cross_entropy(forward(dp.module, X[rows], step), y[rows], reduction="sum")
            phalanx.shard_loss(loss_sum, 10).backward()
            dp.finish_gradient_sync()
            optimizer.step()
        out[overlap] = _cpu(dp.module)
        dp.close()
    reference = model()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05, weight_decay=0.1)
    for step, (X, y) in enumerate(batches):
        if step == 2:
            reference["trunk"].requires_grad_(True)
        optimizer.zero_grad()
        F.cross_entropy(forward(reference, X, step), y).backward()
        optimizer.step()
    out["one device"] = _cpu(reference)
    return out


def test_unused_and_unfrozen_parameters_on_cuda_equal_one_device():
    for result in _launch(unused_worker):
        for overlap in (True, False):
            for name, want in result["one device"].items():
                torch.testing.assert_close(result[overlap][name], want, **TOL)


def amp_worker(world: World) -> dict:
    """torch.amp's fp16 recipe on CUDA buckets: a GradScaler whose first scales overflow (those steps
    skipped), `optimizer.zero_grad()` instead of the replica's (each gradient taken back into its
    bucket as it lands), the NaN/Inf check every 3 steps: it trains on, with finite weights."""
    import warnings

    import phalanx

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(world.device)
    dp = phalanx.prepare(model, world=world, overlap=True, check_finite_every=3)
    optimizer = torch.optim.SGD(dp.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler(world.device.type, init_scale=2.0 ** 60)
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(10):
            X, y = torch.randn(16, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen)
            rows = rank_shard(torch.arange(16), rank=world.rank, world_size=world.world_size)
            optimizer.zero_grad()
            with torch.autocast(world.device.type, dtype=torch.float16):
                loss_sum = F.cross_entropy(dp(X[rows].to(world.device)), y[rows].to(world.device), reduction="sum")
            scaler.scale(phalanx.shard_loss(loss_sum, 16)).backward()
            dp.finish_gradient_sync()
            scaler.step(optimizer)
            scaler.update()
    out = {"scale": scaler.get_scale(), "weights": _cpu(dp.module),
           "notices": [str(w.message) for w in said if issubclass(w.category, phalanx.PhalanxWarning)]}
    dp.close()
    return out


def test_the_fp16_grad_scaler_recipe_trains_through_its_skipped_steps_on_cuda():
    first, second = _launch(amp_worker)
    assert first["scale"] < 2.0 ** 60 and first["scale"] == second["scale"]  # it skipped overflowing steps
    for name, value in first["weights"].items():
        assert bool(value.isfinite().all()) and torch.equal(value, second["weights"][name]), name
    assert len(first["notices"]) == 1 and "no update applied it" in first["notices"][0] and second["notices"] == []


def gan_worker(world: World) -> dict:
    """pytorch/examples' DCGAN step on CUDA buckets, overlapped over several buckets: D's two
    backwards (real, then fake; the second forward sums the first's buckets apart), then G's loss
    through D, whose gradients no step reads (summed, then zeroed at D's next zero_grad)."""
    import phalanx

    def models():
        torch.manual_seed(0)
        return (torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)),
                torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))

    def steps(G, D, rows, finish):
        gen = torch.Generator().manual_seed(3)
        opt_G, opt_D = torch.optim.Adam(G.parameters(), lr=0.01), torch.optim.Adam(D.parameters(), lr=0.01)

        def bce(out, target):
            loss = F.binary_cross_entropy_with_logits(out, torch.full_like(out, target), reduction="sum")
            return phalanx.shard_loss(loss, 12)
        for _ in range(3):
            real = torch.randn(12, 4, generator=gen, dtype=torch.float64)[rows].to(world.device)
            noise = torch.randn(12, 3, generator=gen, dtype=torch.float64)[rows].to(world.device)
            D.zero_grad()
            fake = G(noise)
            bce(D(real), 1.0).backward()
            bce(D(fake.detach()), 0.0).backward()
            finish(D)
            opt_D.step()
            G.zero_grad()
            bce(D(fake), 1.0).backward()
            finish(G)
            opt_G.step()

    rows = rank_shard(torch.arange(12), rank=world.rank, world_size=world.world_size)
    G, D = (m.double().to(world.device) for m in models())
    options = dict(world=world, overlap=True, bucket_cap_mb=0.0001)
    with phalanx.prepare(G, **options) as dG, phalanx.prepare(D, **options) as dD:
        steps(dG, dD, rows, lambda dp: dp.finish_gradient_sync())
        out = {"G": _cpu(dG.module), "D": _cpu(dD.module), "buckets": len(dD.buckets)}
    G, D = (m.double().to(world.device) for m in models())
    steps(G, D, slice(0, 12), lambda model: None)
    out["one device"] = {"G": _cpu(G), "D": _cpu(D)}
    return out


def test_dcgans_two_discriminator_backwards_overlapped_on_cuda_equal_one_device():
    for result in _launch(gan_worker):
        assert result["buckets"] >= 2
        for model in ("G", "D"):
            for name, want in result["one device"][model].items():
                torch.testing.assert_close(result[model][name], want, **TOL)
