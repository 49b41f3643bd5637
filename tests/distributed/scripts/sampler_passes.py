"""A DDP script over torch's DistributedSampler, for `phalanx run`'s lines on its passes.

    phalanx run --devices cpu:2 sampler_passes.py forgets|sets|evaluates

forgets: the loop never calls sampler.set_epoch (every epoch reads the first one's order);
sets: it calls it at each epoch's start, as torch's docs ask; evaluates: it does, and evaluates a
set of 31 examples over a DistributedSampler each epoch (padded to 32 on 2 ranks). Prints how many
distinct first batches each rank read.
"""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main(mode: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(32, 4, generator=torch.Generator().manual_seed(1)), torch.arange(32) % 2)
    sampler = DistributedSampler(data, shuffle=True)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    val = TensorDataset(torch.randn(31, 4, generator=torch.Generator().manual_seed(2)), torch.arange(31) % 2)
    val_loader = DataLoader(val, batch_size=8, sampler=DistributedSampler(val, shuffle=False))
    firsts = []
    for epoch in range(4):
        if mode != "forgets":
            sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(loader):  # the epoch's loop
            firsts += [x[0, 0].item()] if step == 0 else []
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        if mode == "evaluates":
            with torch.no_grad():
                correct = sum((model(x).argmax(1) == y).sum() for x, y in val_loader)  # the evaluation
            dist.all_reduce(correct)
    print(f"rank {dist.get_rank()} distinct first batches {len(set(firsts))}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
