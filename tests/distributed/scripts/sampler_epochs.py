"""A DDP script over torch's DistributedSampler, for `phalanx run`'s line on a forgotten set_epoch.

    phalanx run --devices cpu:2 sampler_epochs.py forgets|sets

forgets: the loop never calls sampler.set_epoch (every epoch reads the first one's order);
sets: it calls it at each epoch's start, as torch's docs ask. Prints each rank's epoch orders.
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
    firsts = []
    for epoch in range(4):
        if mode == "sets":
            sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(loader):  # the epoch's loop
            firsts += [x[0, 0].item()] if step == 0 else []
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    print(f"rank {dist.get_rank()} distinct first batches {len(set(firsts))}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
