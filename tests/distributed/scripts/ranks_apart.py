"""A torchrun-style script whose ranks may train apart, for `phalanx run`'s one line (runtime/apart.py).

    phalanx run --devices cpu:2 ranks_apart.py bare|seeded|data-parallel|alone|rank-lr|ddp|zero|prepare-sharded|
                                                rank-widths|split-by-rank|split-alike

bare: PyTorch's ImageNet example on the CPU (its DDP wrap sits in the GPU branch): a process group,
no wrapper, every rank its own model. seeded: the same with a seed per rank (apart from the start).
data-parallel: the book's concise implementation, torch.nn.DataParallel, one process's own split.
alone: no process group at all (a one-device script started on k workers). rank-lr: DDP, its gradients
summed, and an lr set from the rank. split-by-rank: DDP over a DistributedSampler of a random_split
drawn after a per-rank seed (each rank reads its shard of another split); split-alike: the split
drawn from one generator.
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
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset, random_split

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
    model = DDP(model) if mode in ("ddp", "zero", "rank-lr", "split-by-rank", "split-alike") else model
    model = nn.DataParallel(model) if mode == "data-parallel" else model
    optimizer = (ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.05) if mode == "zero" else
                 torch.optim.SGD(model.parameters(), lr=0.1 * (1 + rank * (mode == "rank-lr")), momentum=0.9))
g = torch.Generator().manual_seed(100 + rank)  # each rank its own part of the data
batches = [(torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(3)]
if mode.startswith("split"):
    data = TensorDataset(torch.randn(64, 6, generator=torch.Generator().manual_seed(0)), torch.arange(64) % 3)
    torch.manual_seed(7 + rank)  # a seed per rank, for augmentation, then the split drawn from it
    train, val = random_split(data, [48, 16], generator=None if mode == "split-by-rank" else
                              torch.Generator().manual_seed(0))
    train_loader = DataLoader(train, batch_size=8, sampler=DistributedSampler(train, shuffle=False))
    batches = list(train_loader)[:3]
for x, y in batches:
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
