"""A GradScaler's unscale_ is refused while a replica holds gradients not yet summed and the
optimizer steps its parameters (guards/unscale.py); otherwise it is torch's own. The replica's
guard is stood in for here (tests/distributed/test_grad_scaler.py runs real replicas)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from phalanx.data_parallel.guards import unscale


class _Guard:
    def __init__(self, params) -> None:
        self.pending, self._ids = False, {id(p) for p in params}

    def steps_module(self, optimizer) -> bool:
        return any(id(p) in self._ids for group in optimizer.param_groups for p in group["params"])


def _scaled_grads(model: nn.Module, scaler) -> None:
    model.zero_grad()
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()


def test_unscale_before_the_sum_is_refused_and_torch_s_own_runs_otherwise():
    model, other = nn.Linear(3, 1), nn.Linear(3, 1)
    guard = _Guard(model.parameters())
    unscale.watch(guard)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    optimizer, other_optimizer = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(other.parameters(), lr=0.1)
    _scaled_grads(model, scaler)
    _scaled_grads(other, scaler)
    guard.pending = True
    with pytest.raises(unscale.UnscaleBeforeSync, match=r"^scaler.unscale_\(optimizer\) \(or scaler.step, which calls "
                                                          r"it\) before dp.finish_gradient_sync\(\)"):
        scaler.unscale_(optimizer)
    with pytest.raises(unscale.UnscaleBeforeSync):
        scaler.step(optimizer)
    assert torch.equal(model.bias.grad, torch.full((1,), 16.0))  # untouched: 2 rows x scale 8
    scaler.unscale_(other_optimizer)  # another model's optimizer: not this replica's business
    assert torch.equal(other.bias.grad, torch.full((1,), 2.0))
    guard.pending = False  # summed: torch's own unscale_
    scaler.unscale_(optimizer)
    assert torch.equal(model.bias.grad, torch.full((1,), 2.0))
    disabled = torch.amp.GradScaler("cpu", enabled=False)
    guard.pending = True
    disabled.unscale_(optimizer)  # a disabled scaler does nothing, so nothing to refuse


def test_the_wrapper_is_installed_once():
    unscale.watch(_Guard([]))
    before = torch.amp.GradScaler.unscale_
    unscale.watch(_Guard([]))
    assert torch.amp.GradScaler.unscale_ is before and len(unscale._WRAPPED) == 1
    assert before.__wrapped__ is unscale._WRAPPED[0]
