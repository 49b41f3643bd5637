"""Replicas that train apart on 2 gloo processes, caught at the first check point in one line:
a checkpoint loaded on rank 0 only after prepare (Horovod's habit) at step 1's check, an lr
scheduler stepped on rank 0 only at evaluate_dataset, ReduceLROnPlateau stepped on each rank's
own metric at phalanx.checkpoint, a weight changed on one rank at dp.close(), a scheduler on
rank 0 of a ZeRO-3 replica (whose ranks hold different ranges) by its lr; and what legitimately
runs stays silent - an EMA copy, a frozen teacher, frozen parameters, local BatchNorm, running
statistics left unaveraged, ZeRO-1/2/3 with every check every step. The Horovod script itself
under `phalanx run` ends 1 with the line alone."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.data_parallel import DataParallelConfig
from phalanx.data_parallel.guards.checks import ReplicaMismatch
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parent / "scripts" / "load_on_rank0.py"


def _data(rows: int = 64):
    g = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randn(rows, 6, generator=g, dtype=torch.float64),
                                          torch.randint(0, 3, (rows,), generator=g))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def _steps(dp, opt, world, data, epochs: int = 1, after_epoch=None) -> None:
    loader = phalanx.ShardedLoader(data, world=world, global_batch_size=16, seed=0)
    for epoch in range(epochs):
        for (x, y), gs in loader.epoch(epoch):
            opt.zero_grad()
            phalanx.shard_loss(F.cross_entropy(dp(x), y, reduction="sum"), gs).backward()
            dp.finish_gradient_sync()
            opt.step()
        if after_epoch is not None:
            after_epoch(epoch)


def _outcome(case, world, out: str) -> str:
    """What `case(world, out, made)` ends in: "ok", or the ReplicaMismatch's line; the replicas it
    made (`made`) are closed either way, without their checks (which ran, or raised, where it called them)."""
    made = []
    try:
        case(world, out, made)
    except ReplicaMismatch as exc:
        return str(exc)
    finally:
        for dp in made:
            dp._close()
    return "ok"


def _prepared(made, *args, **kwargs):
    made.append(phalanx.prepare(*args, **kwargs))
    return made[-1]


def _load_on_rank0(world, out, made):
    dp = _prepared(made, _model(), world=world)
    opt = torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9)
    if world.rank == 0:  # Horovod: rank 0 reads the file, broadcast_parameters would follow
        saved = {k: v + 0.25 for k, v in dp.state_dict().items()}
        dp.load_state_dict(saved)
    _steps(dp, opt, world, _data())


def _scheduler_on_rank0(world, out, made):
    dp = _prepared(made, _model(), world=world)
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    _steps(dp, opt, world, _data(), epochs=2, after_epoch=lambda epoch: (
        sched.step() if world.is_main else None, phalanx.evaluate_dataset(dp, _data(), world=world)))


def _scheduler_on_rank0_module(world, out, made):
    """The README's form, evaluate_dataset(dp.module, ...), an epoch after the lrs parted: the parameters differ
    too, and the line names the lr (it named only a checkpoint loaded on some ranks)."""
    dp = _prepared(made, _model(), world=world)
    opt = torch.optim.AdamW([{"params": dp.module[0].parameters()},
                             {"params": dp.module[2].parameters(), "weight_decay": 0.0}], lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    _steps(dp, opt, world, _data(), epochs=2, after_epoch=lambda epoch: (
        sched.step() if world.is_main else None,
        epoch == 1 and phalanx.evaluate_dataset(dp.module, _data(), world=world)))


def _plateau_on_own_metric(world, out, made):
    dp = _prepared(made, _model(), world=world)
    opt = torch.optim.SGD(dp.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.3, patience=0)
    own_loss = [1.0, 0.5 if world.rank == 0 else 2.0]  # each rank's loss on its own shard: rank 1's got worse
    _steps(dp, opt, world, _data(), epochs=2, after_epoch=lambda epoch: sched.step(own_loss[epoch]))
    phalanx.checkpoint(out, world=world, model=dp, optimizer=opt, epoch=2, global_batch_size=16, seed=0)


def _weight_changed_on_one_rank(world, out, made):
    dp = _prepared(made, _model(), world=world)
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    _steps(dp, opt, world, _data())
    if world.rank == 1:
        with torch.no_grad():
            dp.module[2].bias[0] += 1e-9
    made.remove(dp)
    dp.close()


def _zero3_scheduler_on_rank0(world, out, made):
    dp = _prepared(made, _model(), world=world, shard="parameters")
    opt = dp.optimizer(torch.optim.SGD, lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    _steps(dp, opt, world, _data(), after_epoch=lambda epoch: sched.step() if world.rank == 0 else None)
    phalanx.evaluate_dataset(dp, _data(), world=world)


DIVERGING = {"load_on_rank0": _load_on_rank0, "scheduler_on_rank0": _scheduler_on_rank0,
             "scheduler_on_rank0_module": _scheduler_on_rank0_module,
             "plateau": _plateau_on_own_metric, "close": _weight_changed_on_one_rank,
             "zero3": _zero3_scheduler_on_rank0}


def _diverging(world, out: str) -> dict:
    return {name: _outcome(case, world, os.path.join(out, name)) for name, case in DIVERGING.items()}


@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
    return run_workers(_diverging, 2, str(tmp_path_factory.mktemp("diverging")), timeout_s=240)


LOAD = ("a checkpoint loaded (or weights changed) on some ranks only after phalanx.prepare, as Horovod scripts load "
        "on rank 0 before broadcast_parameters: load on every rank, or before prepare, which broadcasts rank 0's state")
SETTING = ("an lr scheduler stepped (or an optimizer setting changed) on some ranks only, under `if world.is_main:` "
           "or on each rank's own metric (ReduceLROnPlateau on a local validation loss): step it on every rank, on a "
           "metric averaged over the ranks (phalanx.reduce(value, world=world))")


def _one_line(diverged, name) -> str:
    (line,) = {rank[name] for rank in diverged}  # every rank raised the same line
    return line


def test_a_load_on_rank_0_after_prepare_is_caught_at_the_first_step(diverged):
    line = _one_line(diverged, "load_on_rank0")
    assert re.fullmatch(r"replicas diverged \(found at step 1's check: the first step and every 100 steps\): "
                        r"rank 1's parameters differ from rank 0's by up to 0\.25 \(in 4 of 4 tensors, 0\.weight "
                        r"first\); " + re.escape(LOAD), line), line


def test_a_scheduler_stepped_on_rank_0_is_caught_at_the_evaluation(diverged):
    assert _one_line(diverged, "scheduler_on_rank0") == (
        "replicas diverged (found by evaluate_dataset() after step 4): rank 1's optimizer's lr is 0.1 where rank "
        f"0's is 0.05 (param group 0); {SETTING}")


def test_a_scheduler_on_rank_0_is_named_by_the_evaluation_of_dp_module(diverged):
    assert _one_line(diverged, "scheduler_on_rank0_module") == (
        "replicas diverged (found by evaluate_dataset() after step 8): rank 1's parameters differ from rank 0's by "
        "up to 0.0188 (in 4 of 4 tensors, 0.weight first), and its optimizer's lr is 0.01 where rank 0's is 0.0025 "
        f"(param group 0); {SETTING}; or {LOAD}")


def test_a_plateau_scheduler_on_each_ranks_own_loss_is_caught_at_the_checkpoint(diverged):
    assert _one_line(diverged, "plateau") == (
        "replicas diverged (found by phalanx.checkpoint() after step 8): rank 1's optimizer's lr is 0.015 where "
        f"rank 0's is 0.05 (param group 0); {SETTING}")


def test_a_weight_changed_on_one_rank_is_caught_at_close(diverged):
    line = _one_line(diverged, "close")
    assert line.startswith("replicas diverged (found by close() after step 4): rank 1's parameters differ from "
                           "rank 0's by up to 1e-09 (in 1 of 4 tensors, 2.bias first); "), line


def test_a_zero3_replica_compares_its_optimizer_settings(diverged):
    assert _one_line(diverged, "zero3") == (
        "replicas diverged (found by evaluate_dataset() after step 4): rank 1's optimizer's lr is 0.1 where rank "
        f"0's is 0.05 (param group 0); {SETTING}")


class _BN(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.out = nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Linear(16, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.bn(self.fc(x))))


def _silent(world, out: str) -> dict:
    """Legitimate runs, every check on at every step: each must end "ok"."""
    results = {}

    def run(name, make, *, optimizer=lambda dp: torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9),
            copies: bool = True, fresh=_model):
        def case(world, out, made):
            dp = make()
            made.append(dp)
            opt = optimizer(dp)
            sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)  # on every rank
            # An EMA copy updated on every rank, and a teacher built alike on every rank (not of a ZeRO-3 module).
            others = [torch.optim.swa_utils.AveragedModel(fresh()), _model()] if copies else []
            _steps(dp, opt, world, _data(), epochs=2, after_epoch=lambda epoch: (
                sched.step(), others and others[0].update_parameters(dp.module),
                [phalanx.evaluate_dataset(m, _data(), world=world) for m in [dp, *others]]))
            phalanx.checkpoint(out, world=world, model=dp, optimizer=opt, epoch=2, global_batch_size=16, seed=0)
            made.remove(dp)
            dp.close()
        results[name] = _outcome(case, world, os.path.join(out, name))

    every = {"check_finite_every": 1}
    run("plain", lambda: phalanx.prepare(_model(), world=world, **every))
    run("adam", lambda: phalanx.prepare(_model(), world=world, **every),
        optimizer=lambda dp: torch.optim.AdamW([{"params": dp.module[0].parameters()},
                                                {"params": dp.module[2].parameters(), "weight_decay": 0.0}], lr=0.01))

    def frozen():
        model = _model()
        model[0].requires_grad_(False)
        return phalanx.prepare(model, world=world, **every)
    run("frozen", frozen, optimizer=lambda dp: torch.optim.SGD([p for p in dp.parameters() if p.requires_grad],
                                                               lr=0.1, momentum=0.9))
    run("batchnorm local", lambda: phalanx.prepare(_BN().double(), world=world, batchnorm="local", **every),
        fresh=lambda: _BN().double())
    run("batchnorm sync", lambda: phalanx.prepare(_BN().double(), world=world, **every), fresh=lambda: _BN().double())
    # Unaveraged running statistics differ by design until averaged: the new checks leave buffers alone.
    unaveraged = DataParallelConfig(average_running_stats=False, check_finite_every=1)
    results["statistics unaveraged"] = _outcome(lambda world, out, made: _unaveraged(world, out, unaveraged), world,
                                                os.path.join(out, "unaveraged"))
    for shard in ("optimizer", "gradients", "parameters"):
        run(f"zero {shard}", lambda: phalanx.prepare(_model(), world=world, shard=shard, **every),
            optimizer=lambda dp: dp.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9), copies=shard != "parameters")
    return results


def _unaveraged(world, out, options):
    torch.manual_seed(0)
    dp = phalanx.DataParallel(_BN().double(), world=world, options=options)
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    _steps(dp, opt, world, _data())
    phalanx.checkpoint(out, world=world, model=dp, optimizer=opt, epoch=1, global_batch_size=16, seed=0)
    dp.close()


def test_legitimate_runs_checked_at_every_step_stay_silent(tmp_path):
    results = run_workers(_silent, 2, str(tmp_path), timeout_s=300)
    assert results[0] == results[1] == {name: "ok" for name in results[0]}, results
    assert len(results[0]) == 9


def test_the_horovod_resume_script_ends_1_with_the_line_alone(tmp_path):
    def run(mode):
        return subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", "--timeout", "60",
                               "--quiet", str(SCRIPT), mode, str(tmp_path / "ckpt.pt")], capture_output=True,
                              text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})

    fresh = run("fresh")
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    resumed = run("resume")
    assert resumed.returncode == 1, resumed.stderr[-2000:]
    (line,) = resumed.stderr.strip().splitlines()
    assert line.startswith("phalanx: run stopped: replicas diverged (found at step 1's check: the first step and "
                           "every 100 steps): rank 1's parameters differ from rank 0's by up to "), line
    assert "exit normally" not in resumed.stdout
