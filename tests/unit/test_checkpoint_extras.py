"""`phalanx.checkpoint(..., extras=)` and `phalanx.resume(..., extras=)` in one process: a
learning-rate schedule, a GradScaler and an EMA model saved beside the weights continue where they
stood, so the resumed run's next steps equal the uninterrupted run's; without them the schedule
restarts (the run differs). Wrong extras are one-line errors before anything is written or
applied: an object that cannot save its state, a state a weights-only load would refuse (the file
would read as damaged), names that differ between the checkpoint and the resume. The k-worker
resume is tests/distributed/test_run_script.py (examples/quickstart.py's warm-up)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phalanx
from phalanx.errors import UsageError
from phalanx.runtime.world import World

WORLD1 = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), backend="none",
               timeout_s=5.0)
BATCH, SEED = 16, 0


class _Run:
    """A float64 model, SGD with momentum, a warm-up then cosine schedule, an EMA of the weights."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).double()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        warmup = torch.optim.lr_scheduler.LinearLR(self.optimizer, start_factor=0.1, total_iters=4)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=10)
        self.schedule = torch.optim.lr_scheduler.SequentialLR(self.optimizer, [warmup, cosine], milestones=[4])
        self.ema = torch.optim.swa_utils.AveragedModel(
            self.model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)

    def extras(self) -> dict:
        return {"schedule": self.schedule, "ema": self.ema, "scaler": self.scaler}

    def step(self, i: int) -> None:
        g = torch.Generator().manual_seed(i)
        X, y = torch.randn(BATCH, 3, generator=g, dtype=torch.float64), torch.randn(BATCH, 1, generator=g,
                                                                                   dtype=torch.float64)
        self.optimizer.zero_grad()
        self.scaler.scale(((self.model(X) - y) ** 2).mean()).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.schedule.step()
        self.ema.update_parameters(self.model)

    def state(self) -> dict:
        return {"model": {k: v.clone() for k, v in self.model.state_dict().items()},
                "ema": {k: v.clone() for k, v in self.ema.state_dict().items()},
                "lr": self.optimizer.param_groups[0]["lr"], "scale": self.scaler.get_scale()}


def _save(run: _Run, directory, *, extras: dict | None) -> None:
    phalanx.checkpoint(directory, world=WORLD1, model=run.model, optimizer=run.optimizer, epoch=0, step=6,
                       global_batch_size=BATCH, seed=SEED, extras=extras)


def _resume(run: _Run, directory, *, extras: dict | None) -> phalanx.Position:
    return phalanx.resume(directory, world=WORLD1, model=run.model, optimizer=run.optimizer, global_batch_size=BATCH,
                          seed=SEED, extras=extras)


def _equal(a: dict, b: dict) -> bool:
    return (a["lr"] == b["lr"] and a["scale"] == b["scale"]
            and all(torch.equal(a[part][k], b[part][k]) for part in ("model", "ema") for k in a[part]))


def test_a_resumed_run_continues_its_schedule_scaler_and_ema_as_the_uninterrupted_one(tmp_path):
    straight = _Run()
    for i in range(12):
        straight.step(i)
    stopped = _Run()
    for i in range(6):
        stopped.step(i)
    _save(stopped, tmp_path, extras=stopped.extras())
    resumed = _Run()  # a new process: everything built afresh, then resumed
    assert _resume(resumed, tmp_path, extras=resumed.extras()) == phalanx.Position(epoch=0, step=6)
    for i in range(6, 12):
        resumed.step(i)
    assert _equal(resumed.state(), straight.state())
    # The same resume without the extras: weights and momentum go on, the schedule starts over.
    _save(stopped, tmp_path / "bare", extras=None)
    bare = _Run()
    _resume(bare, tmp_path / "bare", extras=None)
    for i in range(6, 12):
        bare.step(i)
    assert not _equal(bare.state(), straight.state())


class _Counter:
    """An object of the user's whose state holds a value a weights-only load refuses."""

    def __init__(self, value) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"count": 3, "best": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["best"]


@pytest.mark.parametrize("extras, match", [
    ([1], r"^extras takes a dict of names to objects, got list; e\.g\. extras=\{'scheduler': scheduler"),
    ({"": _Counter(1.0)}, r"^extras' names are the keys its states are saved under: non-empty strings, got ''$"),
    ({"best": 0.93}, r"^extras\['best'\] is a float, which has no state_dict\(\) and load_state_dict\(\); extras "
                     r"takes objects that save and load their state \(a learning-rate scheduler"),
    ({"counter": _Counter(object())}, r"^extras\['counter'\]\.state_dict\(\)\['best'\] holds a builtins\.object; a "
                                      r"checkpoint holds only what torch\.load\(weights_only=True\) reads back"),
])
def test_wrong_extras_are_one_line_before_anything_is_written(tmp_path, extras, match):
    run = _Run()
    with pytest.raises(TypeError, match=match) as info:
        _save(run, tmp_path, extras=extras)
    assert "\n" not in str(info.value) and not any(tmp_path.iterdir())
    if not any(isinstance(v, _Counter) for v in getattr(extras, "values", lambda: [])()):
        with pytest.raises(TypeError, match=match):  # resume checks them too, with no checkpoint there yet
            _resume(run, tmp_path, extras=extras)


def test_a_numpy_scalar_in_a_state_is_named_with_its_type(tmp_path):
    numpy = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match=r"extras\['counter'\]\.state_dict\(\)\['best'\] holds a numpy\.float64"):
        _save(_Run(), tmp_path, extras={"counter": _Counter(numpy.float64(0.5))})


def test_names_that_differ_between_checkpoint_and_resume_are_refused_before_anything_is_applied(tmp_path):
    saved = _Run()
    saved.step(0)
    _save(saved, tmp_path, extras={"schedule": saved.schedule, "scaler": saved.scaler})
    run = _Run()
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    with pytest.raises(UsageError, match=r"holds the state of extras 'scaler', which this resume was not given; "
                                         r"pass phalanx\.resume the extras phalanx\.checkpoint was given "
                                         r"\(extras=\{'scaler': \.\.\.\}\)"):
        _resume(run, tmp_path, extras={"schedule": run.schedule})
    with pytest.raises(UsageError, match=r"holds no state for extras 'ema' \(saved without them\); resume from a "
                                         r"checkpoint saved with the same extras, or drop them"):
        _resume(run, tmp_path, extras={"schedule": run.schedule, "scaler": run.scaler, "ema": run.ema})
    assert all(torch.equal(v, before[k]) for k, v in run.model.state_dict().items())  # nothing applied
    assert run.schedule.last_epoch == 0


def test_an_extra_that_does_not_take_the_saved_state_is_one_line(tmp_path):
    saved = _Run()
    _save(saved, tmp_path, extras={"ema": saved.ema})
    other = torch.optim.swa_utils.AveragedModel(nn.Linear(2, 2).double())
    with pytest.raises(UsageError, match=r"extras\['ema'\] \(AveragedModel\) does not take the saved state \("
                                         r".*\); resume with the object that saved it$"):
        _resume(_Run(), tmp_path, extras={"ema": other})


def _schedulers(o: torch.optim.Optimizer) -> dict:
    L = torch.optim.lr_scheduler
    return {"LambdaLR": L.LambdaLR(o, lambda s: 0.9 ** s), "MultiplicativeLR": L.MultiplicativeLR(o, lambda s: 0.9),
            "StepLR": L.StepLR(o, 3), "MultiStepLR": L.MultiStepLR(o, [2, 5]), "ConstantLR": L.ConstantLR(o),
            "LinearLR": L.LinearLR(o), "ExponentialLR": L.ExponentialLR(o, 0.9), "PolynomialLR": L.PolynomialLR(o),
            "CosineAnnealingLR": L.CosineAnnealingLR(o, 10), "ReduceLROnPlateau": L.ReduceLROnPlateau(o),
            "CyclicLR": L.CyclicLR(o, 0.01, 0.1), "OneCycleLR": L.OneCycleLR(o, 0.1, total_steps=20),
            "CosineAnnealingWarmRestarts": L.CosineAnnealingWarmRestarts(o, 5),
            "SequentialLR": L.SequentialLR(o, [L.LinearLR(o), L.ExponentialLR(o, 0.9)], [3])}


def test_every_torch_scheduler_s_state_is_taken_and_loads_back(tmp_path):
    """None of torch's own schedulers is refused (MultiStepLR keeps its milestones in a Counter)."""
    model = nn.Linear(2, 1).double()
    made = _schedulers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for name, scheduler in made.items():
        optimizer = scheduler.optimizer
        for _ in range(3):
            optimizer.step()
            scheduler.step(1.0) if name == "ReduceLROnPlateau" else scheduler.step()
        phalanx.checkpoint(tmp_path / name, world=WORLD1, model=model, optimizer=optimizer, epoch=0, step=3,
                           global_batch_size=BATCH, seed=SEED, extras={"schedule": scheduler})
        fresh = _schedulers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))[name]
        phalanx.resume(tmp_path / name, world=WORLD1, model=model, optimizer=fresh.optimizer, global_batch_size=BATCH,
                       seed=SEED, extras={"schedule": fresh})
        assert fresh.last_epoch == scheduler.last_epoch and fresh.optimizer.param_groups[0]["lr"] == \
            optimizer.param_groups[0]["lr"], name
