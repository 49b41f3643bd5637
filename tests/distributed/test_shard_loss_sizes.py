"""A global size that differs between the ranks is named once, at synced step 1, 2, 4, 8, ..., on rank 0.

`shard_loss(loss_sum, (labels != pad).sum())` divides each rank's sum by its own count of real
tokens: the global batch size is one number for the whole global batch, and with each rank's
own the summed gradient is not the 1-device gradient (an outside-user trial: 2 workers ended 0.17
relative from one device, silently). Every rank notes what its shard_loss calls got in synced
steps 1, 2, 4, 8, ... and the ranks compare it in one small sum after each; the same sizes, a
different number of calls (a loss term of a rank's own), or a difference only between those
steps: nothing.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx

pytestmark = pytest.mark.distributed


def _steps(sizes_per_step: list[list[list[int]]]) -> list[str]:
    """Per step, per rank: the sizes its shard_loss calls get (one call per size). Rank 0's warnings."""
    world = phalanx.init()
    torch.manual_seed(0)
    dp = phalanx.prepare(nn.Linear(4, 3), world=world)
    X, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for sizes in sizes_per_step:
            dp.zero_grad()
            for size in sizes[world.rank]:
                phalanx.shard_loss(F.cross_entropy(dp(X), y, reduction="sum"), size).backward()
            dp.finish_gradient_sync()
    dp.close()
    return [str(w.message) for w in caught if issubclass(w.category, phalanx.PhalanxWarning)]


@pytest.mark.parametrize("case, sizes_per_step, said", [
    ("each rank's own count", [[[61], [57]]],
     "phalanx.shard_loss got global_batch_size=61 on rank 0 but 57 on rank 1 at synced step 1: the global batch "
     "size is one number for the whole global batch, the same on every rank (for a count of tokens: each rank's "
     "count summed over the ranks, phalanx.reduce(count, world=world)); divided by each rank's own count the summed "
     "gradient is not the 1-device gradient"),
    ("micro-batches, one differs", [[[118, 118], [118, 117]]],
     "phalanx.shard_loss got global_batch_size values summing to 236 over 2 calls on rank 0 but 235 on rank 1 at "
     "synced step 1"),
    ("the same everywhere", [[[118], [118]]], None),
    ("micro-batches alike", [[[118, 118], [118, 118]]], None),
    ("a loss term of rank 0's own", [[[118, 5], [118]]], None),
    # Before 2026-12-03 only the first step was compared: padding from step 2 trained 0.21 off, silently.
    ("from step 2", [[[118], [118]], [[61], [57]]], "got global_batch_size=61 on rank 0 but 57 on rank 1 at synced "
     "step 2"),
    ("from step 3, named at 4", [[[118], [118]]] * 2 + [[[61], [57]], [[60], [59]]], "got global_batch_size=60 on "
     "rank 0 but 59 on rank 1 at synced step 4"),
    ("at step 3 only", [[[118], [118]]] * 2 + [[[61], [57]], [[60], [60]]], None),
])
def test_a_size_that_differs_between_ranks_is_named_at_a_power_of_two_step(case, sizes_per_step, said):
    zero, one = phalanx.launch(_steps, sizes_per_step, devices="cpu:2", timeout_s=60, quiet=True)
    assert one == []  # rank 0 speaks for the run
    if said is None:
        assert zero == [], zero
    else:
        assert len(zero) == 1 and said in zero[0], zero
