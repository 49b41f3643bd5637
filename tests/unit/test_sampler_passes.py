"""A shuffling DistributedSampler whose set_epoch is never called (runtime/sampler_passes.py): said
once on rank 0 when a second training pass (one with an optimizer step) reaches its end at one epoch, at the
script's `for` line; a loop that moves the epoch, passes that take no step (an evaluation, the
training set's accuracy), a pass left early, a sampler that does not shuffle, and rank 1 hear nothing.
End to end under `phalanx run`: tests/distributed/test_sampler_passes.py."""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from phalanx.errors import PhalanxWarning
from phalanx.runtime.sampler_passes import watching_sampler_passes

DATA = TensorDataset(torch.arange(12.0))


def _said(*, rank: int = 0, shuffle: bool = True, set_epoch: bool, epochs: int = 3, trains: bool = True,
          evaluates: bool = False, leaves_early: bool = False):
    sampler = DistributedSampler(DATA, num_replicas=2, rank=rank, shuffle=shuffle, seed=3)
    loader = DataLoader(DATA, batch_size=2, sampler=sampler)
    weight = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    orders = []
    with warnings.catch_warnings(record=True) as caught, watching_sampler_passes(rank=rank):
        warnings.simplefilter("always")
        for epoch in range(epochs):
            if set_epoch:
                sampler.set_epoch(epoch)
            orders.append([])
            for (x,) in loader:  # the loop's line
                orders[-1] += x.tolist()
                if trains:
                    optimizer.zero_grad()
                    (weight * x.sum()).backward()
                    optimizer.step()
                if leaves_early:
                    break
            if evaluates:  # the training set's accuracy, each epoch: a pass without a step
                with torch.no_grad():
                    sum(x.sum() for (x,) in loader)
    return [w for w in caught if issubclass(w.category, PhalanxWarning)], orders


def test_a_forgotten_set_epoch_is_said_once_at_the_scripts_line():
    said, orders = _said(set_epoch=False, evaluates=True)
    assert len(said) == 1 and orders[0] == orders[1] == orders[2]  # torch's own: one order, every epoch
    assert str(said[0].message).startswith("this DistributedSampler (shuffle=True) reached the end of a second "
                                           "training pass at epoch 0: its set_epoch was not called")
    assert "call sampler.set_epoch(epoch) at each epoch's start" in str(said[0].message)
    assert said[0].filename == __file__ and "the loop's line" in open(__file__).read().splitlines()[said[0].lineno - 1]


def test_loops_that_move_the_epoch_passes_without_a_step_and_other_ranks_hear_nothing():
    said, orders = _said(set_epoch=True, evaluates=True)
    assert said == [] and orders[0] != orders[1]
    assert _said(set_epoch=False, trains=False)[0] == []  # a shuffling sampler over a validation set
    assert _said(set_epoch=False, leaves_early=True)[0] == []  # no pass ended
    assert _said(set_epoch=False, shuffle=False)[0] == [] and _said(set_epoch=False, rank=1)[0] == []
    assert _said(set_epoch=False, epochs=1)[0] == []


def test_the_sampler_and_the_step_hook_are_put_back_after():
    from torch.optim import optimizer

    original, hooks = DistributedSampler.__iter__, len(optimizer._global_optimizer_post_hooks)
    with watching_sampler_passes(rank=0):
        assert DistributedSampler.__iter__ is not original
        assert len(optimizer._global_optimizer_post_hooks) == hooks + 1
    assert DistributedSampler.__iter__ is original and len(optimizer._global_optimizer_post_hooks) == hooks


def _evaluated(size: int, *, drop_last: bool = False, rank: int = 0, trains: bool = False, no_grad: bool = True):
    data = TensorDataset(torch.arange(float(size)))
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=2, rank=rank, shuffle=False,
                                                                      drop_last=drop_last))
    weight = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    with warnings.catch_warnings(record=True) as caught, watching_sampler_passes(rank=rank):
        warnings.simplefilter("always")
        for _ in range(2):
            with torch.no_grad() if no_grad and not trains else contextlib.nullcontext():
                for (x,) in loader:  # the evaluation's line
                    if trains:
                        optimizer.zero_grad()
                        (weight * x.sum()).backward()
                        optimizer.step()
    return [w for w in caught if issubclass(w.category, PhalanxWarning)]


def test_an_evaluation_over_an_uneven_sampler_is_said_once_with_what_it_repeats_or_leaves_out():
    padded = _evaluated(11)
    assert len(padded) == 1 and str(padded[0].message).startswith(
        "this DistributedSampler reached the end of an evaluation's pass (no optimizer step, gradients off) that "
        "reads 1 of its 11 examples twice (it pads them to 12 so that 2 ranks get equal shares), so metrics summed "
        "over the ranks are not one device's")
    assert str(padded[0].message).endswith("evaluate with phalanx.evaluate_dataset(model, dataset, world=world), "
                                           "which counts every example once")
    assert "the evaluation's line" in open(__file__).read().splitlines()[padded[0].lineno - 1]
    assert "leaves 1 of its 11 examples out (drop_last=True)" in str(_evaluated(11, drop_last=True)[0].message)
    assert _evaluated(12) == [] and _evaluated(11, rank=1) == [] and _evaluated(11, trains=True) == []
    assert _evaluated(11, no_grad=False) == []  # gradients on and no step: not told from a training pass


def test_a_pass_read_by_an_installed_librarys_loop_is_said_at_the_scripts_call_naming_the_library(tmp_path):
    """PyTorch-Ignite's Engine draws the batches: the warning points at the script's `trainer.run(...)`,
    the line its author changes, and names the library's line that reached the end."""
    import importlib.util

    library = tmp_path / "site-packages" / "fake_engine.py"
    library.parent.mkdir()
    library.write_text("def run(loader, step, epochs):\n    for _ in range(epochs):\n"
                       "        for batch in loader:\n            step(batch)\n")
    spec = importlib.util.spec_from_file_location("fake_engine", library)
    engine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(engine)
    loader = DataLoader(DATA, batch_size=2, sampler=DistributedSampler(DATA, num_replicas=2, rank=0, seed=3))
    weight = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=0.1)

    def step(batch):
        optimizer.zero_grad()
        (weight * batch[0].sum()).backward()
        optimizer.step()

    with warnings.catch_warnings(record=True) as caught, watching_sampler_passes(rank=0):
        warnings.simplefilter("always")
        engine.run(loader, step, 2)  # the script's call
    (said,) = [w for w in caught if issubclass(w.category, PhalanxWarning)]
    assert said.filename == __file__ and "the script's call" in open(__file__).read().splitlines()[said.lineno - 1]
    assert str(said.message).endswith("takes the epoch (reached in fake_engine, line 3)")
