"""A torchrun-style script whose ranks may train apart, for `phalanx run`'s one line (runtime/apart.py).

    phalanx run --devices cpu:2 ranks_apart.py bare|seeded|alone|rank-lr|ddp|zero|prepare-sharded|rank-widths

bare: PyTorch's ImageNet example on the CPU (its DDP wrap sits in the GPU branch): a process group,
no wrapper, every rank its own model. seeded: the same with a seed per rank (apart from the start).
alone: no process group at all (a one-device script started on k workers). rank-lr: DDP, its gradients
summed, and an lr set from the rank.
The others sum their gradients, or hold rank-sized parts by design: nothing may be said.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

mode = sys.argv[1]
if mode != "alone":
    dist.init_process_group("gloo")
rank = int(os.environ["RANK"])
torch.manual_seed(rank if mode == "seeded" else 0)
width = 8 + rank if mode == "rank-widths" else 8
model = nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, 3))
if mode == "prepare-sharded":
    import phalanx
    model = phalanx.prepare(model, world=phalanx.init(), shard="optimizer", average=True)
    optimizer = model.optimizer(torch.optim.AdamW, lr=0.05)
else:
    model = DDP(model) if mode in ("ddp", "zero", "rank-lr") else model
    optimizer = (ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.05) if mode == "zero" else
                 torch.optim.SGD(model.parameters(), lr=0.1 * (1 + rank * (mode == "rank-lr")), momentum=0.9))
g = torch.Generator().manual_seed(100 + rank)  # each rank its own part of the data
for step in range(3):
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    if mode == "prepare-sharded":
        model.finish_gradient_sync()
    optimizer.step()
if mode == "prepare-sharded":
    model.close()
if dist.is_initialized():
    dist.destroy_process_group()
print(f"rank {rank} done")
