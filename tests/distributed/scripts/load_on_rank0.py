"""Horovod's resume habit, ported as it is: rank 0 alone loads the checkpoint (model and optimizer)
after `phalanx.prepare`, where Horovod's `broadcast_parameters` / `broadcast_optimizer_state`
followed. The replicas then train apart; the replica check must stop the run at its first step.

    phalanx run --devices cpu:2 load_on_rank0.py fresh|resume CHECKPOINT
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn

import phalanx

mode, path = sys.argv[1], sys.argv[2]
torch.set_default_dtype(torch.float64)
world = phalanx.init()
torch.manual_seed(0)
dp = phalanx.prepare(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)), world=world)
opt = torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9)
g = torch.Generator().manual_seed(3)
data = torch.utils.data.TensorDataset(torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g))
loader = phalanx.ShardedLoader(data, world=world, global_batch_size=32, seed=0)
if mode == "resume" and world.rank == 0:  # Horovod: only rank 0 reads the file
    saved = torch.load(path, weights_only=True)
    dp.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
for epoch in range(2):
    for (x, y), global_size in loader.epoch(epoch):
        opt.zero_grad()
        phalanx.shard_loss(F.cross_entropy(dp(x), y, reduction="sum"), global_size).backward()
        dp.finish_gradient_sync()
        opt.step()
    sums = phalanx.evaluate_dataset(dp, data, world=world)
    world.print(f"epoch {epoch} acc {sums['correct'] / sums['count']:.4f}")
if world.is_main:
    torch.save({"model": dp.state_dict(), "optimizer": opt.state_dict()}, path)
dp.close()
world.print("exit normally")
