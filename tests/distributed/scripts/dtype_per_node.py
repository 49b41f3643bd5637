"""A torchrun script whose node 1 builds its model in float32 and node 0 in float64 (the same
architecture): phalanx.prepare must refuse it on every node in one line, before its broadcast."""

import os

import torch

import phalanx

world = phalanx.init()
dtype = torch.float64 if int(os.environ.get("GROUP_RANK", "0")) == 0 else torch.float32
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).to(dtype)
phalanx.prepare(model, world=world)
print("prepared", flush=True)
