"""A mid-epoch resume is exact when the dataset augments with the global RNG (`torch.rand` in
`__getitem__`, as torchvision's random transforms do), with and without loader workers, on 2 gloo
workers in float64: a run checkpointed at step 2 of epoch 1 and resumed by a fresh model,
optimizer and loader - from other RNG states, through the documented loop (`phalanx.resume(...,
loader=loader)`, then `continue` for the steps done) - ends bitwise where the uninterrupted run
ends. Without `loader=` the skipped batches drew from the restored RNG states again and (with
workers) the workers' seeds were drawn at the resumed step, not the epoch's start: the trial's
BatchNorm CNN ended 3.7e-2 (2.1e-2 with 2 workers) away, silently. A checkpoint saved with
`loader=` and resumed without it is one warning on rank 0, and so is a mid-epoch checkpoint
without `loader=` while the loop's loader is inside its epoch."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

N, BATCH, EPOCHS, SEED = 45, 8, 2, 3
STOP = (1, 2)  # the checkpoint: 2 steps of epoch 1 done


class _Flipped(torch.utils.data.Dataset):
    """N examples of 6 features, 3 classes; each read flips the features' sign with probability
    1/2 and adds noise, both from the global RNG."""

    def __init__(self, augment: bool = True) -> None:
        self.augment = augment
        g = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(N, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (N,), generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        if not self.augment:
            return self.x[i], self.y[i]
        x = -self.x[i] if torch.rand(()) < 0.5 else self.x[i]
        return x + 0.1 * torch.randn(6, dtype=torch.float64), self.y[i]


def _run(world, directory: str, num_workers: int, *, resume: bool, with_loader: bool = True,
         save_loader: bool = True, augment: bool = True, dropout: float = 0.0):
    """Train EPOCHS epochs (saving at STOP), or resume from `directory` and finish; the flat parameters."""
    torch.manual_seed(11 if resume else 0)  # a resumed run's own states: the checkpoint's must win
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Dropout(dropout), nn.Linear(8, 3)).double()
    dp = phalanx.prepare(model, world=world)
    optimizer = torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9)
    loader = phalanx.ShardedLoader(_Flipped(augment), world=world, global_batch_size=BATCH, seed=SEED,
                                   num_workers=num_workers)
    keys = {"world": world, "model": dp, "optimizer": optimizer, "global_batch_size": BATCH, "seed": SEED}
    start = phalanx.Position(epoch=0, step=0)
    if resume:
        start = phalanx.resume(directory, **keys, loader=loader if with_loader else None)
    for epoch in range(start.epoch, EPOCHS):
        for step, ((x, y), global_size) in enumerate(loader.epoch(epoch)):
            if epoch == start.epoch and step < start.step:
                continue
            optimizer.zero_grad()
            phalanx.shard_loss(F.cross_entropy(dp(x), y, reduction="sum"), global_size).backward()
            dp.finish_gradient_sync()
            optimizer.step()
            if (epoch, step + 1) == STOP and not resume:
                phalanx.checkpoint(directory, **keys, epoch=epoch, step=step + 1,
                                   loader=loader if save_loader else None)
    flat = torch.cat([v.detach().reshape(-1) for v in dp.module.state_dict().values() if v.is_floating_point()])
    dp.close()
    return flat


def _worker(world, root: str) -> dict:
    found = {}
    for num_workers in (0, 2):
        directory = f"{root}/workers{num_workers}"
        full = _run(world, directory, num_workers, resume=False)
        resumed = _run(world, directory, num_workers, resume=True)
        found[num_workers] = (full, resumed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(world, f"{root}/workers0", 0, resume=True, with_loader=False)
    found["said"] = [str(w.message) for w in caught if issubclass(w.category, phalanx.PhalanxWarning)]
    with warnings.catch_warnings(record=True) as caught:  # the checkpoint itself, mid-epoch without loader=
        warnings.simplefilter("always")
        _run(world, f"{root}/without", 0, resume=False, save_loader=False)
    found["saved without"] = [str(w.message) for w in caught if issubclass(w.category, phalanx.PhalanxWarning)]
    return found


def test_a_mid_epoch_resume_replays_the_augmentation_bitwise(tmp_path):
    results = run_workers(_worker, 2, str(tmp_path), timeout_s=240)
    for num_workers in (0, 2):
        full, resumed = results[0][num_workers]
        assert torch.equal(full, resumed), (num_workers, (full - resumed).abs().max().item())
        assert torch.equal(results[1][num_workers][1], resumed)  # one model on both ranks
    said = results[0]["said"]
    assert len(said) == 1 and "pass loader=loader to phalanx.resume too" in said[0] and "\n" not in said[0], said
    assert results[1]["said"] == []
    without = results[0]["saved without"]
    assert len(without) == 1 and without[0].startswith("phalanx.checkpoint at step 2 of an epoch without loader=: "
                                                       "pass loader=loader"), without
    assert "augmentation in __getitem__ with num_workers=0" in without[0], without
    assert results[1]["saved without"] == []


def _without_loader(world, root: str) -> dict:
    """Saved and resumed without loader=: a step with dropout on plain data, and augmentation in
    2 loader workers; then the warning a resume without loader= gives."""
    found = {}
    for name, num_workers, augment, dropout in (("dropout", 0, False, 0.3), ("workers", 2, True, 0.0)):
        directory, kinds = f"{root}/{name}", {"augment": augment, "dropout": dropout}
        full = _run(world, directory, num_workers, resume=False, save_loader=False, **kinds)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resumed = _run(world, directory, num_workers, resume=True, with_loader=False, **kinds)
        said = [str(w.message) for w in caught if issubclass(w.category, phalanx.PhalanxWarning)]
        found[name] = (full, resumed, said)
    return found


def test_a_resume_without_loader_is_exact_unless_this_process_draws_while_loading(tmp_path):
    """Each epoch's DataLoader iterator drew its workers' base seed from torch's generator, so a
    resumed epoch's start moved the step's draws by one: dropout on plain data resumed 1.3e-1 off
    (2 workers, float64), augmentation in 2 loader workers 3.1e-2. Now the seed comes from (seed,
    epoch); the one case left, draws made while loading in the training process, is named on resume."""
    results = run_workers(_without_loader, 2, str(tmp_path), timeout_s=240)
    for name in ("dropout", "workers"):
        full, resumed, said = results[0][name]
        assert torch.equal(full, resumed), (name, ((full - resumed).abs().max() / full.abs().max()).item())
        assert torch.equal(results[1][name][1], resumed)
        assert len(said) == 1 and said[0].startswith("resuming without loader=: checkpoint ") and \
            "is at step 2 of epoch 1" in said[0] and "with num_workers=0" in said[0] and "\n" not in said[0], said
        assert results[1][name][2] == []
