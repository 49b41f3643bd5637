"""A user's loop through `phalanx.prepare` in which one rank's loss turns NaN at one step, for the
finite check's test: the allreduce spreads that rank's NaN gradient to every replica, and the run
must stop naming the step and the rank. With the check off it runs on and saves NaN weights.
`--leave` is how the state leaves the replica at the end: full_state_dict (every rank), state_dict
(rank 0 alone, DDP's habit), checkpoint (phalanx.checkpoint) or close (nothing saved).

    phalanx run --devices cpu:2 nan_on_one_rank.py --nan-step 3 --nan-rank 1 --check-every 5 --out DIR
"""

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import phalanx

parser = argparse.ArgumentParser()
parser.add_argument("--nan-step", type=int, required=True)
parser.add_argument("--nan-rank", type=int, required=True)
parser.add_argument("--check-every", type=int, required=True)
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--shard", default="none")
parser.add_argument("--leave", default="full_state_dict",
                    choices=["full_state_dict", "state_dict", "checkpoint", "close"])
args = parser.parse_args()

world = phalanx.init()
torch.manual_seed(0)
dp = phalanx.prepare(nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3)), world=world,
                     check_finite_every=args.check_every, bucket_cap_mb=0.0002, shard=args.shard)  # 2 buckets
optimizer = dp.optimizer(torch.optim.SGD, lr=0.1)
g = torch.Generator().manual_seed(world.rank)
for step in range(1, args.steps + 1):
    X, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
    dp.zero_grad()
    loss = phalanx.shard_loss(F.cross_entropy(dp(X), y, reduction="sum"), 8 * world.world_size)
    if (step, world.rank) == (args.nan_step, args.nan_rank):
        loss = loss * float("nan")  # a bad example on one rank
    loss.backward()
    dp.finish_gradient_sync()
    optimizer.step()
if args.leave == "full_state_dict":
    state = dp.full_state_dict()  # every rank: a sharded replica gathers it
    if world.is_main:
        torch.save(state, args.out / "model.pt")
elif args.leave == "state_dict" and world.is_main:  # rank 0 alone
    torch.save(dp.state_dict(), args.out / "model.pt")
elif args.leave == "checkpoint":
    phalanx.checkpoint(args.out / "checkpoints", world=world, model=dp, optimizer=optimizer, epoch=1,
                       global_batch_size=8 * world.world_size, seed=0)
dp.close()
