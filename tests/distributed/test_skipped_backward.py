"""A rank that runs the replica's forward but no backward, then syncs while its peers backpropagated
(`if rank == 0: loss.backward()`, or a rank that catches its own error between forward and
backward and goes on): its shard is left out of the sum. DDP hangs there; phalanx summed the other
ranks' gradients and trained on, every replica alike, silently off one device. On 2 gloo workers,
float64: the rank that skipped is refused at that sync in one line, after it joined every
collective of the sync (its peer's sync completes), with and without overlap and at every stage
of sharding; a rank whose forward saw no examples (an empty shard) and every rank
skipping alike (one device would have no gradient either) stay allowed.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed

SETTINGS = (("overlap off", dict(overlap=False)), ("overlap on", dict(overlap=True, algorithm="native")),
            ("shard optimizer", dict(overlap=False, shard="optimizer")),
            ("shard gradients", dict(overlap=False, shard="gradients")),
            ("shard parameters", dict(overlap=False, shard="parameters")))
CASES = ("rank 1 skips", "empty shard skips", "every rank skips")


def _step(dp, world, case: str, step: int) -> None:
    x = torch.randn(4, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (4,))
    if case == "empty shard skips" and step == 1 and world.rank == 1:
        x, y = x[:0], y[:0]
    dp.zero_grad()
    loss = phalanx.shard_loss(F.cross_entropy(dp(x), y, reduction="sum"), 8)
    skips = step == 1 and (case == "every rank skips" or world.rank == 1)
    if not skips:
        loss.backward()
    dp.finish_gradient_sync()


def _worker(world) -> dict:
    warnings.simplefilter("ignore")
    out = {}
    for name, options in SETTINGS:
        for case in CASES:
            torch.manual_seed(0)
            dp = phalanx.prepare(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double(),
                                 world=world, **options)
            result = "ok"
            for step in range(2):  # the skip at the last step: after it both ranks close
                try:
                    _step(dp, world, case, step)
                except RuntimeError as exc:
                    result = str(exc)
                    break
            out[name, case] = result
            dp.close()  # both ranks joined the refused sync's collectives: the replicas still agree
    return out


@pytest.fixture(scope="module")
def results():
    return run_workers(_worker, 2, timeout_s=240)


@pytest.mark.parametrize("name", [name for name, _ in SETTINGS])
def test_a_rank_that_skipped_its_backward_is_refused_at_the_sync(results, name):
    refused = results[1][name, "rank 1 skips"]
    assert "no backward reached the replica's parameters" in refused, refused
    assert refused.startswith("rank 1's forward took 4 example(s)") and "0 * loss" in refused, refused
    assert "\n" not in refused
    assert results[0][name, "rank 1 skips"] == "ok"  # its sync completed: the peer is named by the launcher


@pytest.mark.parametrize("name", [name for name, _ in SETTINGS])
@pytest.mark.parametrize("case", ["empty shard skips", "every rank skips"])
def test_an_empty_shard_or_every_rank_skipping_alike_is_allowed(results, name, case):
    assert [out[name, case] for out in results] == ["ok", "ok"]
