"""A DDP user's habits on 2 gloo ranks, one spawn for all of them:

- a mean loss is named in one warning on rank 0 at the first step (and never again, nor on rank 1);
  through `shard_loss` nothing is said; `average=True` is DDP's mean of per-rank means and ends
  where torch's own DDP ends (float64, equal shards);
- torch's DistributedSampler in the loop is named with how many examples it repeats;
- plain BatchNorm through a DataParallel built directly: one notice naming the choices, and the
  replicas' buffers bitwise identical after uneven steps; with the averaging off they drift,
  and the replica check and `evaluate_dataset` then name the buffer on every rank;
- DDP's `module.`-prefixed state_dict loads into a DataParallel, and the replica's loads back;
- `reduce` sums and averages; `accumulate` sends one exchange per step and gives the 1-device
  gradient; `precision="bf16-mixed"` keeps float32 buckets and identical replicas;
- nanoGPT's accumulation, `dp.require_backward_grad_sync = (last micro-batch)`, overlapped: one
  exchange per step and the 1-device gradient; set False with buckets in flight, one line;
- DCGAN's loop (pytorch/examples): the discriminator's two backwards (real, then fake), overlapped
  over several buckets and not; the generator's loss backpropagates through the discriminator,
  whose gradients no step uses and whose zero_grad sums, then zeroes them, also under ZeRO stage
  3, against one device; no mean-loss warning for the generator's shard_loss through D;
- WGAN-GP's critic step, whose gradient penalty differentiates through the replica
  (`torch.autograd.grad(..., create_graph=True)`), then a siamese loss of two forwards and one
  backward, overlapped and not, against one device;
- an embedding with `sparse=True`: no notice, a sparse gradient after the sync, and SGD with
  momentum ends where one device's sparse gradients end;
- torch's `clip_grad_norm_` before `finish_gradient_sync()`, overlapped and not: refused on every
  rank once summed; clipped after the sync, the 1-device clipped gradient.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import phalanx
from phalanx.data import split_batch
from phalanx.errors import RunFailed
from phalanx.data_parallel.guards.checks import check_replicas
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

GLOBAL = 12  # examples per global batch: shards of 6 and 6 (even), or 7 and 5 (uneven)


def _batches(steps: int, dtype=torch.float64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(GLOBAL, 4, generator=g, dtype=dtype), torch.randint(0, 3, (GLOBAL,), generator=g))
            for _ in range(steps)]


def _shard(X, y, world, uneven: bool = False):
    if not uneven:
        return split_batch(X, y, world.world_size)[world.rank]
    rows = slice(0, 7) if world.rank == 0 else slice(7, GLOBAL)
    return X[rows], y[rows]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).double()


def _phalanx_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, phalanx.PhalanxWarning)]


def _train(dp, world, batches, *, mean_loss: bool, uneven: bool = False) -> None:
    optimizer = torch.optim.SGD(dp.parameters(), lr=0.1)
    for X, y in batches:
        X, y = _shard(X, y, world, uneven)
        dp.zero_grad()
        out = dp(X)
        loss = F.cross_entropy(out, y) if mean_loss else phalanx.shard_loss(
            F.cross_entropy(out, y, reduction="sum"), GLOBAL)
        loss.backward()
        dp.finish_gradient_sync()
        optimizer.step()


def _state(module: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _loss_cases(world, out: dict) -> None:
    for name, mean_loss, average in (("mean", True, None), ("shard_loss", False, None), ("ddp-mean", True, True)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with phalanx.DataParallel(_mlp(), world=world, options=phalanx.DataParallelConfig(average=average)) as dp:
                _train(dp, world, _batches(3), mean_loss=mean_loss)
                out[f"{name}-state"] = _state(dp)
        out[f"{name}-warnings"] = _phalanx_warnings(caught)
    ddp = DistributedDataParallel(_mlp())  # torch's own, the reference for average=True
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for X, y in _batches(3):
        X, y = _shard(X, y, world)
        optimizer.zero_grad()
        F.cross_entropy(ddp(X), y).backward()
        optimizer.step()
    out["ddp-state"] = _state(ddp.module)
    with phalanx.DataParallel(_mlp(), world=world) as dp:  # DDP's checkpoint keys load as they are
        dp.load_state_dict(ddp.state_dict())
        out["ddp-loaded"] = _state(dp)


def _sampler_case(world, out: dict) -> None:
    dataset = TensorDataset(torch.randn(9, 4, dtype=torch.float64), torch.randint(0, 3, (9,)))
    loader = DataLoader(dataset, batch_size=3, sampler=DistributedSampler(dataset, shuffle=False))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with phalanx.DataParallel(_mlp(), world=world) as dp:
            for X, y in loader:  # DDP's loop, with the loss made right: only the sampler is left
                dp.zero_grad()
                phalanx.shard_loss(F.cross_entropy(dp(X), y, reduction="sum"), 6).backward()
                dp.finish_gradient_sync()
    out["sampler-warnings"] = _phalanx_warnings(caught)


def _batchnorm_cases(world, out: dict) -> None:
    for name, averaged in (("bn-averaged", True), ("bn-drifting", False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dp = phalanx.DataParallel(_bn_net(), world=world,
                                      options=phalanx.DataParallelConfig(average_running_stats=averaged))
            _train(dp, world, _batches(4), mean_loss=False, uneven=True)
        out[f"{name}-warnings"] = _phalanx_warnings(caught)
        out[f"{name}-state"] = _state(dp)
        for check, call in (("replicas", lambda: check_replicas(world, dp, step=4)),
                            ("evaluate", lambda: phalanx.evaluate_dataset(
                                dp, TensorDataset(torch.randn(5, 4, dtype=torch.float64),
                                                  torch.randint(0, 3, (5,))), world=world))):
            try:
                call()
                out[f"{name}-{check}"] = "ok"
            except RunFailed as exc:
                out[f"{name}-{check}"] = str(exc)
        dp.close()


class _CountingTracer:
    def __init__(self) -> None:
        self.launched = 0

    def comm_launched(self, bucket_index: int, size_bytes: int, kind: str = "allreduce") -> int:
        self.launched += 1
        return 0

    def comm_done(self, record: int) -> None:
        pass


def _helper_cases(world, out: dict) -> None:
    out["reduce"] = (phalanx.reduce(world.rank + 1, op="sum", world=world),
                     phalanx.reduce(torch.tensor(world.rank + 1.0), world=world),
                     phalanx.reduce(torch.tensor([world.rank, 1.0]), op="sum", world=world).tolist(),
                     # "max" / "min": missing before 2026-12-03 (one line naming mean, sum)
                     phalanx.reduce(torch.tensor(world.rank + 0.5), op="max", world=world),
                     phalanx.reduce(-7 * world.rank, op="min", world=world),
                     phalanx.reduce(torch.tensor([world.rank, -world.rank]), op="max", world=world).tolist())
    X, y = _batches(1)[0]
    with phalanx.DataParallel(_mlp(), world=world, options=phalanx.DataParallelConfig(bucket_cap_mb=0.0005)) as dp:
        dp.tracer = tracer = _CountingTracer()
        X_shard, y_shard = _shard(X, y, world, uneven=True)
        dp.zero_grad()
        for X_micro, y_micro in dp.accumulate(list(zip(X_shard.split(3), y_shard.split(3)))):
            phalanx.shard_loss(F.cross_entropy(dp(X_micro), y_micro, reduction="sum"), GLOBAL).backward()
        dp.finish_gradient_sync()
        out["accumulate"] = ([p.grad.clone() for p in dp.parameters()], tracer.launched, len(dp.buckets))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    with phalanx.prepare(model, world=world, precision="bf16-mixed") as dp:
        _train(dp, world, _batches(3, torch.float32), mean_loss=False)
        out["bf16"] = (_state(dp), {b.buffer.dtype for b in dp.buckets}, dp.choices.describe())


def _nanogpt_case(world, out: dict) -> None:
    """nanoGPT's loop: DDP's flag set before each micro-batch, no no_sync(), overlap forced on."""
    X, y = _batches(1)[0]
    options = phalanx.DataParallelConfig(bucket_cap_mb=0.0005, overlap=True)
    with phalanx.DataParallel(_mlp(), world=world, options=options) as dp:
        dp.tracer = tracer = _CountingTracer()
        X_shard, y_shard = _shard(X, y, world, uneven=True)
        dp.zero_grad()
        micro_batches = list(zip(X_shard.split(3), y_shard.split(3)))
        for index, (X_micro, y_micro) in enumerate(micro_batches):
            dp.require_backward_grad_sync = index == len(micro_batches) - 1
            phalanx.shard_loss(F.cross_entropy(dp(X_micro), y_micro, reduction="sum"), GLOBAL).backward()
        in_flight = dp.exchange_in_flight
        try:
            dp.require_backward_grad_sync = False
            refused = ""
        except RuntimeError as error:
            refused = str(error)
        dp.finish_gradient_sync()
        out["nanogpt"] = ([p.grad.clone() for p in dp.parameters()], tracer.launched, len(dp.buckets), in_flight,
                          refused, dp.require_backward_grad_sync)


def _gan() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return (nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 4)).double(),
            nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double())


def _gan_steps(G, D, step_G, step_D, zero_G, zero_D, rows, *, one_backward: bool, optimizers=None) -> None:
    """DCGAN's step: D on real and fake.detach(), then G through D (D's gradients left unused)."""
    g = torch.Generator().manual_seed(7)
    optimizer_G, optimizer_D = optimizers or (torch.optim.Adam(G.parameters(), lr=0.01),
                                              torch.optim.Adam(D.parameters(), lr=0.01))

    def bce(out, target):
        return phalanx.shard_loss(F.binary_cross_entropy_with_logits(out, torch.full_like(out, target),
                                                                     reduction="sum"), GLOBAL)
    for _ in range(3):
        real, noise = torch.randn(GLOBAL, 4, generator=g, dtype=torch.float64)[rows], torch.randn(
            GLOBAL, 3, generator=g, dtype=torch.float64)[rows]
        zero_D()
        fake = G(noise)
        if one_backward:
            (bce(D(real), 1.0) + bce(D(fake.detach()), 0.0)).backward()
        else:  # DCGAN's two backwards: the second forward sums the first apart when buckets went out
            bce(D(real), 1.0).backward()
            bce(D(fake.detach()), 0.0).backward()
        step_D()
        optimizer_D.step()
        zero_G()
        bce(D(fake), 1.0).backward()  # lands gradients in D too: zero_D sums and zeroes them at the next step
        step_G()
        optimizer_G.step()


def _gan_case(world, out: dict) -> None:
    rows = slice(0, 7) if world.rank == 0 else slice(7, GLOBAL)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # DCGAN's two backwards: after backward; overlapped over several buckets (a forward between
        # them sums the first apart); overlapped with one backward of the two losses added.
        for case, overlap, one_backward in (("False", False, False), ("True", True, False), ("True-one", True, True)):
            G, D = _gan()
            options = dict(world=world, overlap=overlap, bucket_cap_mb=0.0001)
            with phalanx.prepare(G, **options) as dG, phalanx.prepare(D, **options) as dD:
                dD.tracer = tracer = _CountingTracer()
                _gan_steps(dG, dD, dG.finish_gradient_sync, dD.finish_gradient_sync, dG.zero_grad, dD.zero_grad,
                           rows, one_backward=one_backward)
                out[f"gan-{case}"] = (_state(dG), _state(dD))
                out[f"gan-{case}-buckets"], out[f"gan-{case}-launched"] = len(dD.buckets), tracer.launched
    out["gan-warnings"] = _phalanx_warnings(caught)  # G's shard_loss runs through D's graph: nothing to name
    for case, overlap in (("sharded", True), ("sharded-False", False)):  # ZeRO stage 3
        G, D = _gan()
        sharded = dict(world=world, shard="parameters", overlap=overlap)
        with phalanx.prepare(G, **sharded) as dG, phalanx.prepare(D, **sharded) as dD:
            dD.tracer = tracer = _CountingTracer()
            optimizers = dG.optimizer(torch.optim.Adam, lr=0.01), dD.optimizer(torch.optim.Adam, lr=0.01)
            _gan_steps(dG, dD, dG.finish_gradient_sync, dD.finish_gradient_sync, dG.zero_grad, dD.zero_grad, rows,
                       one_backward=True, optimizers=optimizers)
            out[f"gan-{case}"] = (dG.full_state_dict(), dD.full_state_dict())
            out[f"gan-{case}-launched"] = tracer.launched


def _critic() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def _critic_steps(D, step, zero, rows) -> None:
    """WGAN-GP's critic loss (a penalty on the input gradient's norm), then a siamese loss."""
    g = torch.Generator().manual_seed(9)
    optimizer = torch.optim.Adam(D.parameters(), lr=0.01)
    for _ in range(3):
        real, fake, alpha, a, b = (torch.randn(GLOBAL, 4, generator=g, dtype=torch.float64)[rows] for _ in range(5))
        zero()
        mixed = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
        grads, = torch.autograd.grad(D(mixed).sum(), mixed, create_graph=True)
        penalty = ((grads.norm(2, dim=1) - 1) ** 2).sum()
        phalanx.shard_loss(D(fake).sum() - D(real).sum() + 10 * penalty, GLOBAL).backward()
        step()
        optimizer.step()
        zero()
        phalanx.shard_loss((D(a) - D(b)).pow(2).sum(), GLOBAL).backward()
        step()
        optimizer.step()


def _critic_case(world, out: dict) -> None:
    rows = slice(0, 7) if world.rank == 0 else slice(7, GLOBAL)
    for overlap in (False, True):
        with phalanx.prepare(_critic(), world=world, overlap=overlap) as dD:
            _critic_steps(dD, dD.finish_gradient_sync, dD.zero_grad, rows)
            out[f"critic-{overlap}"] = _state(dD)


def _embedding_bag() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.EmbeddingBag(20, 4, mode="sum", sparse=True), nn.Linear(4, 3)).double()


def _sparse_case(world, out: dict) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dp = phalanx.prepare(_embedding_bag(), world=world)
    out["sparse-warnings"] = [(str(w.message), w.filename) for w in caught
                              if issubclass(w.category, phalanx.PhalanxWarning)]
    optimizer = torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9)
    with dp:
        for X, y in _sparse_batches():
            X, y = _shard(X, y, world, uneven=True)
            dp.zero_grad()
            phalanx.shard_loss(F.cross_entropy(dp(X), y, reduction="sum"), GLOBAL).backward()
            dp.finish_gradient_sync()
            out["sparse-layout"] = dp.module[0].weight.grad.layout
            optimizer.step()
        out["sparse-state"] = _state(dp)


def _sparse_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, 20, (GLOBAL, 3), generator=g), torch.randint(0, 3, (GLOBAL,), generator=g))
            for _ in range(3)]


def _clip_case(world, out: dict) -> None:
    """torch's clip_grad_norm_ before finish_gradient_sync(), overlapped and not: refused on every rank."""
    X, y = _batches(1)[0]
    X, y = _shard(X, y, world, uneven=True)
    for overlap in (False, True):
        with phalanx.prepare(_mlp(), world=world, overlap=overlap, bucket_cap_mb=0.0005) as dp:
            phalanx.shard_loss(F.cross_entropy(dp(X), y, reduction="sum"), GLOBAL).backward()
            torch.nn.utils.clip_grad_norm_(dp.parameters(), 1e-3)
            try:
                dp.finish_gradient_sync()
            except phalanx.UsageError as error:
                out[f"clip-{overlap}"] = str(error)
            dp.zero_grad()  # and on: the next step, clipped after the sum, is the replica's as usual
            phalanx.shard_loss(F.cross_entropy(dp(X), y, reduction="sum"), GLOBAL).backward()
            dp.finish_gradient_sync()
            torch.nn.utils.clip_grad_norm_(dp.parameters(), 1e-3)
            out[f"clip-{overlap}-grads"] = [p.grad.clone() for p in dp.parameters()]


def _worker(world) -> dict:
    out: dict = {}
    _loss_cases(world, out)
    _sampler_case(world, out)
    _batchnorm_cases(world, out)
    _helper_cases(world, out)
    _nanogpt_case(world, out)
    _sparse_case(world, out)
    _gan_case(world, out)
    _critic_case(world, out)
    _clip_case(world, out)
    return out


@pytest.fixture(scope="module")
def results():
    return run_workers(_worker, 2, timeout_s=180)


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in b)


def test_a_mean_loss_is_named_once_on_rank_0_and_shard_loss_is_not(results):
    first, second = results
    assert len(first["mean-warnings"]) == 1, first["mean-warnings"]
    assert first["mean-warnings"][0].startswith("this step's backward did not come through phalanx.shard_loss: "
                                                "gradients are summed over the 2 ranks")
    assert second["mean-warnings"] == [] and first["shard_loss-warnings"] == [] and first["ddp-mean-warnings"] == []
    # The mean loss's run is the lr x 2 run: far from the right one.
    assert _max_diff(first["mean-state"], first["shard_loss-state"]) > 1e-3


def test_average_true_is_ddps_mean_of_means(results):
    for rank in results:
        assert _max_diff(rank["ddp-mean-state"], rank["ddp-state"]) < 1e-13
        # On equal shards the mean of means is the global mean: shard_loss's update.
        assert _max_diff(rank["ddp-mean-state"], rank["shard_loss-state"]) < 1e-13
    assert _max_diff(results[0]["ddp-loaded"], results[0]["ddp-state"]) == 0.0


def test_a_padding_distributed_sampler_is_named_on_rank_0(results):
    assert results[0]["sampler-warnings"] == [
        "torch's DistributedSampler pads the 9 examples to 10 by repeating 1 so that 2 ranks get equal shares (as "
        "DDP does), so an epoch is not the 1-device epoch; use phalanx.ShardedLoader(dataset, world=world, "
        "global_batch_size=..., shuffle=True), which splits every global batch exactly, the last one unevenly"]
    assert results[1]["sampler-warnings"] == []


def test_plain_batchnorm_replicas_stay_bitwise_identical_and_drift_is_caught_otherwise(results):
    first, second = results
    assert len(first["bn-averaged-warnings"]) == 1 and "batchnorm=\"sync\"" in first["bn-averaged-warnings"][0]
    assert second["bn-averaged-warnings"] == []
    for key, value in first["bn-averaged-state"].items():
        assert torch.equal(value, second["bn-averaged-state"][key]), key
    assert (first["bn-averaged-replicas"], first["bn-averaged-evaluate"]) == ("ok", "ok")
    drifted = first["bn-drifting-state"]["1.running_mean"] - second["bn-drifting-state"]["1.running_mean"]
    assert drifted.abs().max() > 1e-3  # what the averaging prevents: shards 7 and 5 give other statistics
    for rank in results:  # every rank raises the same line
        said, far, cause = rank["bn-drifting-replicas"].partition(" by up to ")[0], *rank[
            "bn-drifting-replicas"].partition(" by up to ")[2].partition("; ")[::2]
        assert said == "replicas diverged at step 4: rank 1's 1.running_mean (a buffer) differs from rank 0's"
        assert float(far) == pytest.approx(drifted.abs().max().item(), rel=1e-2)  # how far apart, in the line
        assert cause == ("a norm layer's statistics, which the forward updates from each rank's own data; keep "
                         "DataParallel's average_running_stats=True, or use batchnorm=\"sync\"")
        assert rank["bn-drifting-evaluate"].startswith("replicas diverged before evaluation: rank 1's 1.running_mean")


def test_nanogpt_s_require_backward_grad_sync_accumulates_as_no_sync_does(results):
    X, y = _batches(1)[0]
    reference = _mlp()
    phalanx.shard_loss(F.cross_entropy(reference(X), y, reduction="sum"), GLOBAL).backward()
    for rank in results:
        grads, launched, num_buckets, in_flight, refused, flag = rank["nanogpt"]
        assert num_buckets > 1 and launched == num_buckets and in_flight  # overlapped, once per step
        for got, want in zip(grads, reference.parameters()):
            torch.testing.assert_close(got, want.grad, rtol=1e-12, atol=1e-15)
        assert refused == ("require_backward_grad_sync = False set while gradient allreduces are in flight; "
                           "call finish_gradient_sync() first")
        assert flag is True


def test_a_sparse_embedding_is_summed_exactly_and_sparse_again_without_a_notice(results):
    assert results[0]["sparse-warnings"] == results[1]["sparse-warnings"] == []
    assert results[0]["sparse-layout"] == results[1]["sparse-layout"] == torch.sparse_coo
    reference = _embedding_bag()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for X, y in _sparse_batches():
        optimizer.zero_grad()
        phalanx.shard_loss(F.cross_entropy(reference(X), y, reduction="sum"), GLOBAL).backward()
        assert reference[0].weight.grad.is_sparse  # one device steps sparse gradients
        optimizer.step()
    for rank in results:
        assert _max_diff(rank["sparse-state"], _state(reference)) < 1e-13


@pytest.mark.parametrize("case", ["False", "True", "True-one", "sharded", "sharded-False"])
def test_dcgans_loop_drops_the_discriminators_unused_gradients_as_one_device_does(results, case):
    G, D = _gan()
    no_op = lambda: None  # noqa: E731 - one device: nothing to sum
    _gan_steps(G, D, no_op, no_op, lambda: G.zero_grad(), lambda: D.zero_grad(), slice(0, GLOBAL),
               one_backward=case not in ("False", "True"))
    for rank in results:
        state_G, state_D = rank[f"gan-{case}"]
        assert _max_diff(state_G, _state(G)) < 1e-12 and _max_diff(state_D, _state(D)) < 1e-12
        assert not case.startswith("True") or rank[f"gan-{case}-buckets"] >= 2  # overlapped: several buckets
        if case.endswith("False"):  # exchanged after backward: G's backward through D costs D no exchange
            assert rank[f"gan-{case}-launched"] == 3  # one per D step, of one bucket (2 more before 2026-11-29)
    assert all(torch.equal(results[0][f"gan-{case}"][1][k], v) for k, v in results[1][f"gan-{case}"][1].items())
    assert results[0]["gan-warnings"] == []  # before 2026-11-29 G's loss through D was named a mean loss


@pytest.mark.parametrize("overlap", [False, True])
def test_a_gradient_penalty_and_a_siamese_loss_through_the_replica_equal_one_device(results, overlap):
    D = _critic()
    _critic_steps(D, lambda: None, lambda: D.zero_grad(), slice(0, GLOBAL))
    for rank in results:
        assert _max_diff(rank[f"critic-{overlap}"], _state(D)) < 1e-12


def test_reduce_accumulate_and_bf16_mixed_on_two_ranks(results):
    for rank in results:
        assert rank["reduce"] == (3.0, 1.5, [1.0, 2.0], 1.5, -7, [1, 0])
    X, y = _batches(1)[0]
    reference = _mlp()
    phalanx.shard_loss(F.cross_entropy(reference(X), y, reduction="sum"), GLOBAL).backward()
    for rank in results:
        grads, launched, num_buckets = rank["accumulate"]
        assert num_buckets > 1 and launched == num_buckets  # one exchange for the three micro-batches
        for got, want in zip(grads, reference.parameters()):
            torch.testing.assert_close(got, want.grad, rtol=1e-12, atol=1e-15)
    state0, dtypes, describe = results[0]["bf16"]
    assert dtypes == {torch.float32} and "bf16-mixed (autocast forward" in describe
    for key, value in state0.items():
        assert value.dtype == torch.float32 and torch.equal(value, results[1]["bf16"][0][key]), key


@pytest.mark.parametrize("overlap", [False, True])
def test_clipping_before_the_sync_is_refused_on_every_rank_and_after_it_equals_one_device(results, overlap):
    for rank in results:
        assert rank[f"clip-{overlap}"].startswith("the gradients of ") and "were written in place between backward " \
            "and finish_gradient_sync() (torch.nn.utils.clip_grad_norm_ before the sync?)" in rank[f"clip-{overlap}"]
    X, y = _batches(1)[0]
    reference = _mlp()
    phalanx.shard_loss(F.cross_entropy(reference(X), y, reduction="sum"), GLOBAL).backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e-3)
    for rank in results:
        for got, want in zip(rank[f"clip-{overlap}-grads"], reference.parameters()):
            torch.testing.assert_close(got, want.grad, rtol=1e-12, atol=1e-15)


def _destroy_then_close(world) -> str:
    import torch.distributed as dist
    from phalanx.errors import UsageError
    dp = phalanx.prepare(nn.Linear(4, 3), world=world)
    F.cross_entropy(dp(torch.randn(4, 4)), torch.tensor([0, 1, 2, 0]), reduction="sum").backward()
    dp.finish_gradient_sync()
    dist.destroy_process_group()  # nanoGPT's ending, before the replica's own
    try:
        dp.close()
    except UsageError as exc:
        return str(exc)
    return "closed"


def test_close_after_destroy_process_group_is_one_line_naming_the_order():
    # Before 2026-12-03: torch's "Default process group has not been initialized" from inside close().
    assert run_workers(_destroy_then_close, 2, timeout_s=60) == [
        "dp.close() compares the replicas over the process group, which torch.distributed.destroy_process_group() "
        "already tore down: call dp.close() before it"] * 2
