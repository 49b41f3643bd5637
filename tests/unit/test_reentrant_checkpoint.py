"""Reentrant activation checkpointing with the exchange overlapped (overlap.py): a parameter used in
two checkpointed segments lands twice in one backward. DDP refuses it unless told static_graph=True;
the replica learns the count in its first synced backward and overlaps from the second on.

Before 2026-12-05 it was refused at step 1 with "a gradient landed twice ... two backwards with no
forward between them", naming neither the parameter nor the cause (overlap=False and
use_reentrant=False each trained it exactly).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.unit.test_parallel_overlap import FakeComm, _dp


class SharedAcrossSegments(nn.Module):
    """ALBERT's habit: one `shared` layer inside every checkpointed block (and `head` outside)."""

    def __init__(self, blocks: int = 3, reentrant: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(blocks))
        self.shared = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)
        self.reentrant = reentrant
        self.segments = blocks

    def forward(self, x):
        for block in self.blocks[:self.segments]:
            x = checkpoint(lambda t, b=block: self.shared(b(t)).tanh(), x, use_reentrant=self.reentrant)
        return self.head(x)


def _data(step: int):
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(6, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    return x, torch.randint(0, 3, (6,), generator=generator)


def _replica(comm: FakeComm, **model_options):
    torch.manual_seed(0)
    model = SharedAcrossSegments(**model_options).double()
    torch.manual_seed(0)
    reference = SharedAcrossSegments(**model_options).double()
    # small buckets: shared's, each block's and head's gradients go out apart
    return _dp(model, comm, overlap=True, bucket_cap_mb=1100 / 2**20, first_bucket_cap_mb=100 / 2**20), reference


def test_a_layer_shared_by_checkpointed_segments_is_learned_then_overlapped():
    comm = FakeComm()
    dp, reference = _replica(comm)
    assert len(dp.buckets) >= 4
    buckets = len(dp.buckets)
    for step in range(3):
        x, y = _data(step)
        dp.zero_grad()
        F.cross_entropy(dp(x), y, reduction="sum").backward()
        before_finish = len(comm.launches()) - step * buckets
        dp.finish_gradient_sync()
        # the first backward counts (nothing more goes out once checkpoint's backward is seen);
        # from the second on, every bucket goes out during backward, shared's after its 3rd landing
        assert before_finish == (buckets if step else 1), (step, comm.launches())
        reference.zero_grad()
        F.cross_entropy(reference(x), y, reduction="sum").backward()
        for (name, p), q in zip(dp.module.named_parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad), (step, name)


def test_a_landing_beyond_the_learned_count_names_the_parameter_and_the_fixes():
    comm = FakeComm()
    dp, _ = _replica(comm)
    dp.module.segments = 2  # the first step uses shared in 2 segments
    x, y = _data(0)
    F.cross_entropy(dp(x), y, reduction="sum").backward()
    dp.finish_gradient_sync()
    dp.module.segments = 3  # then in 3: its bucket is out after the 2nd
    dp.zero_grad()
    with pytest.raises(RuntimeError) as caught:
        F.cross_entropy(dp(x), y, reduction="sum").backward()
    line = str(caught.value)
    assert line.startswith("shared.weight's gradient landed again after its bucket") or \
        line.startswith("shared.bias's gradient landed again after its bucket"), line
    for said in ("reentrant activation checkpointing", "use_reentrant=False", "overlap=False"):
        assert said in line


def test_without_checkpointing_a_second_landing_is_still_the_two_backwards_refusal():
    comm = FakeComm()
    dp, _ = _replica(comm, reentrant=False)  # non-reentrant: one backward, each parameter lands once
    x, y = _data(0)
    F.cross_entropy(dp(x), y, reduction="sum").backward()
    assert len(comm.launches()) == len(dp.buckets)  # nothing learned: overlapped from the first step
    dp.finish_gradient_sync()
    dp.zero_grad()
    loss = F.cross_entropy(dp(x), y, reduction="sum")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"^head\.(bias|weight)'s gradient landed twice in bucket 0 .*retain_graph"):
        loss.backward()
