"""A sharded optimizer's `state_dict()` is its rank's share, tagged as such: the habit of a whole
optimizer - rank 0 saves `optimizer.state_dict()`, every rank loads it - is refused in one line on
rank 1 (before, rank 1 took rank 0's Adam moments, silently where the shares' shapes matched,
and the resumed run ended 0.03-0.3 relative away from the uninterrupted one); each rank's own
share loads back to the same state; a whole optimizer's state is refused too. And
`phalanx.checkpoint` of a sharded replica makes its directory (each rank wrote its share into a
directory nobody had made yet: "cannot write ... No such file or directory")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx

pytestmark = pytest.mark.distributed


def _save_and_load(directory: str, shard: str) -> dict:
    world = phalanx.init()
    torch.manual_seed(0)
    dp = phalanx.prepare(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)), world=world, shard=shard)
    optimizer = dp.optimizer(torch.optim.Adam, lr=0.01)
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    rows = phalanx.rank_shard(torch.arange(8), rank=world.rank, world_size=world.world_size)
    for _ in range(2):
        optimizer.zero_grad()
        phalanx.shard_loss(F.cross_entropy(dp(x[rows]), y[rows], reduction="sum"), 8).backward()
        dp.finish_gradient_sync()
        optimizer.step()
    here = Path(directory)
    if world.is_main:
        torch.save(optimizer.state_dict(), here / "optimizer.pt")  # the whole optimizer's habit
    torch.save(optimizer.state_dict(), here / f"optimizer-rank{world.rank}.pt")
    phalanx.barrier(world=world)
    outcome = {}
    before = optimizer.state_dict()
    for name, path in (("rank 0's", here / "optimizer.pt"), ("its own", here / f"optimizer-rank{world.rank}.pt")):
        try:
            optimizer.load_state_dict(torch.load(path, weights_only=True))
            outcome[name] = "loaded"
        except ValueError as exc:
            outcome[name] = str(exc)
    after = optimizer.state_dict()
    outcome["unchanged"] = all(torch.equal(before["state"][i][key], after["state"][i][key])
                               for i in before["state"] for key in before["state"][i])
    try:
        optimizer.load_state_dict(torch.optim.Adam(nn.Linear(2, 2).parameters()).state_dict())
        outcome["whole"] = "loaded"
    except ValueError as exc:
        outcome["whole"] = str(exc)
    # phalanx.checkpoint into a directory nobody made yet: each rank writes its share there first.
    phalanx.checkpoint(here / "new" / "checkpoints", world=world, model=dp, optimizer=optimizer, epoch=0, step=2,
                       global_batch_size=8, seed=0)
    outcome["resumed at"] = phalanx.resume(here / "new" / "checkpoints", world=world, model=dp, optimizer=optimizer,
                                           global_batch_size=8, seed=0)
    dp.close()
    return outcome


@pytest.mark.parametrize("shard", ["optimizer", "parameters"])
def test_each_rank_loads_its_own_share_and_rank_0s_is_refused_on_rank_1(tmp_path, shard):
    zero, one = phalanx.launch(_save_and_load, str(tmp_path), shard, devices="cpu:2", timeout_s=60, quiet=True)
    assert zero["rank 0's"] == "loaded" and zero["its own"] == "loaded" and zero["unchanged"]
    assert one["its own"] == "loaded" and one["unchanged"]
    assert one["rank 0's"] == (
        f"this optimizer holds rank 1's share of the optimizer state (shard={shard!r}), but the state_dict given is "
        "rank 0's: each rank's share is its own; save and load with phalanx.checkpoint / phalanx.resume (they "
        "reshard across device counts), or have each rank save and load its own optimizer.state_dict() (a file "
        "per rank)")
    assert zero["whole"].startswith("this optimizer holds rank 0's share of the optimizer state") \
        and "has no share tag: it is a whole optimizer's" in zero["whole"]
    assert zero["resumed at"] == one["resumed at"] == phalanx.Position(epoch=0, step=2)
