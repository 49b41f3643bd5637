"""A stage-3 bucket gathered before an optimizer step or a load is not used after it.

Under `shard="parameters"` a bucket is whole from a layer's forward until every layer owning some
of it has run; a layer's forward also starts the all-gather of the bucket forward needs next (the
neighbouring index), on the communication thread. A layer that does not run in a forward (a head
used in training only, skipped by an evaluation) left its bucket whole and its prefetch in flight,
both holding this rank's range as it was, and the next forward used them as they were: after an
optimizer step in between, the layers computed with the weights before the step; after
`dp.load_state_dict`, with those before the load. On 2 gloo workers, float64, one bucket per tensor:

- an evaluation forward between finish_gradient_sync and the optimizer step: 3 steps ended up to
  4.4 off the unsharded run (every parameter); now they equal it exactly;
- load_state_dict after an evaluation forward: full_state_dict gave the values before the load
  (up to 0.88 off the loaded ones: aux, first.bias, last.weight); now the loaded ones.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phalanx
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed
STEPS, ROWS = 3, 4
TINY_MB = 0.0001  # one bucket per tensor, so a layer's neighbour is another layer's bucket


class WithAuxHead(nn.Module):
    """`aux` runs in training only (Inception's auxiliary classifier), registered between the two."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.aux, self.last = nn.Linear(6, 6), nn.Linear(6, 1), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        out = self.last(h).sum(dim=1, keepdim=True)
        return out + self.aux(h) if self.training else out


def _options(shard: str) -> phalanx.DataParallelConfig:
    return phalanx.DataParallelConfig(shard=shard, overlap=True, allreduce="shm", bucket_cap_mb=TINY_MB,
                                      first_bucket_cap_mb=TINY_MB)


def _trained(world, shard: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    dp = phalanx.DataParallel(WithAuxHead().double(), world=world, options=_options(shard))
    optimizer = dp.optimizer(torch.optim.SGD, lr=0.5) if shard != "none" else torch.optim.SGD(dp.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(world.rank)
    for _ in range(STEPS):
        x = torch.randn(ROWS, 6, dtype=torch.float64, generator=g)
        dp.zero_grad()
        dp.train()
        phalanx.shard_loss(dp(x).pow(2).sum(), 2 * ROWS).backward()
        dp.finish_gradient_sync()
        dp.eval()
        with torch.no_grad():  # a look at the summed step before taking it (the head skipped)
            dp(x)
        optimizer.step()
    state = dp.full_state_dict()
    dp.close()
    return state


def _loaded(world) -> tuple[list[str], dict[str, float]]:
    torch.manual_seed(0)
    dp = phalanx.DataParallel(WithAuxHead().double(), world=world, options=_options("parameters"))
    dp.eval()
    with torch.no_grad():  # the head skipped: what it shares stays whole, its prefetch in flight
        dp(torch.randn(ROWS, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(world.rank)))
    wanted = {name: torch.full(tuple(p.shape), 0.5, dtype=torch.float64) for name, p in dp.module.named_parameters()}
    dp.load_state_dict(wanted)
    got = dp.full_state_dict()
    dp.close()
    return sorted(wanted), {name: (got[name] - value).abs().max().item() for name, value in wanted.items()}


def _worker(world) -> dict:
    none, sharded = _trained(world, "none"), _trained(world, "parameters")
    return {"trained": {name: (none[name] - sharded[name]).abs().max().item() for name in none},
            "loaded": _loaded(world)}


@pytest.fixture(scope="module")
def results():
    return run_workers(_worker, 2, timeout_s=240)


def test_a_forward_skipping_a_layer_then_a_step_trains_as_unsharded(results):
    for rank in results:
        assert rank["trained"] == {name: 0.0 for name in rank["trained"]}


def test_load_state_dict_after_a_forward_skipping_a_layer_keeps_the_loaded_values(results):
    for rank in results:
        names, off = rank["loaded"]
        assert "aux.weight" in names
        assert off == {name: 0.0 for name in names}
