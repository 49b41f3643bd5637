"""A script that saves and resumes through torch.distributed.checkpoint (DCP) on phalanx's replica:
`--steps A B` trains global steps A..B-1 (each step's batch drawn from its own seed), `--load DIR`
resumes from a DCP checkpoint first, `--save DIR` writes one after; rank 0 writes the model's
state and the optimizer state's names to `--out`. Run under `phalanx run --devices cpu:2`."""

import argparse

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import phalanx

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, nargs=2, required=True)
parser.add_argument("--load")
parser.add_argument("--save")
parser.add_argument("--out", required=True)
args = parser.parse_args()

torch.set_default_dtype(torch.float64)
world = phalanx.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
dp = phalanx.prepare(model, world=world)
optimizer = dp.optimizer(torch.optim.AdamW, lr=0.01)
if args.load:  # DCP's resume: templates from the fresh state, loaded in place, set back
    model_state, optimizer_state = get_state_dict(dp, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=args.load)
    set_state_dict(dp, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
for step in range(*args.steps):
    generator = torch.Generator().manual_seed(step)
    x, y = torch.randn(32, 8, generator=generator), torch.randint(0, 2, (32,), generator=generator)
    mine = phalanx.rank_shard(torch.arange(32), rank=world.rank, world_size=world.world_size)
    optimizer.zero_grad()
    phalanx.shard_loss(F.cross_entropy(dp(x[mine]), y[mine], reduction="sum"), 32).backward()
    dp.finish_gradient_sync()
    optimizer.step()
if args.save:
    model_state, optimizer_state = get_state_dict(dp, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=args.save)
if world.rank == 0:
    torch.save({"model": dp.state_dict(), "optimizer keys": sorted(get_state_dict(dp, optimizer)[1]["state"])},
               args.out)
dp.close()
