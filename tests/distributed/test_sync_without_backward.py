"""`dp.finish_gradient_sync()` with no backward since the last sync, on 2 gloo ranks: a no-op in
values that still joins the peers' collectives (a rank whose shard was empty syncs the same way),
so the gradient after it is the one before it - also when the script wrote into the *summed*
gradient in between (a clip after the sync) and under `average=True`, whose division writes the
sum. Before 2026-12-03 those two were refused as a write "between backward and
finish_gradient_sync()" wherever the sync launched the buckets itself (no overlap)."""

from __future__ import annotations

import warnings

import pytest
import torch

import phalanx
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

SETTINGS = (("overlap off", dict(overlap=False)), ("overlap on", dict(overlap=True, algorithm="native")),
            ("average", dict(overlap=False, average=True)))


def _worker(world) -> dict:
    warnings.simplefilter("ignore")  # the mean-loss notice: beside the point here
    out = {}
    for name, options in SETTINGS:
        torch.manual_seed(0)
        dp = phalanx.prepare(torch.nn.Linear(4, 2), world=world, **options)
        x = torch.randn(6, 4)[world.rank * 3:(world.rank + 1) * 3]
        dp(x).sum().backward()
        dp.finish_gradient_sync()
        for param in dp.parameters():
            param.grad.mul_(0.5)  # a clip after the sync: a write into the sum
        before = [param.grad.clone() for param in dp.parameters()]
        try:
            dp.finish_gradient_sync()  # no backward since the last sync
            out[name] = all(torch.equal(b, p.grad) for b, p in zip(before, dp.parameters()))
        except Exception as exc:  # noqa: BLE001 - what the user sees
            out[name] = str(exc)
        dp.close()
    return out


def test_a_sync_with_no_backward_since_the_last_leaves_the_gradient_as_it_is():
    for rank, out in enumerate(run_workers(_worker, 2, timeout_s=120)):
        for name, _ in SETTINGS:
            assert out[name] is True, (rank, name, out[name])
