"""Quickstart: phalanx as a library - your model, your data, your loop, on k workers.

    phalanx run --devices cpu:3 examples/quickstart.py --epochs 5       # 3 CPU workers
    torchrun --nproc-per-node 2 examples/quickstart.py --epochs 5       # the same script, unchanged
    python examples/quickstart.py                                       # one device

A 3-class spiral (generated, so nothing to download) learned by an MLP with GELU that phalanx
does not ship, with Adam, a linear learning-rate warm-up and global-norm gradient clipping. k
workers compute the 1-device run:
same initial weights (rank 0's, broadcast), same global batches (ShardedLoader), the loss sum
over each shard divided by the global batch size (shard_loss), the summed gradient on every
rank, clipped by its global norm. `--out DIR` writes each rank's parameters and Adam state
(rank<r>.pt); `--checkpoint-dir DIR` saves every epoch and resumes from there (the warm-up's
place too: `extras=`).
"""

import argparse
import os
import math

import torch
import torch.nn.functional as F
from torch import nn

import phalanx


class Spiral(torch.utils.data.Dataset):
    """`n` points on 3 interleaved noisy spiral arms; the same points for the same seed."""

    def __init__(self, n: int, *, seed: int, dtype: torch.dtype) -> None:
        g = torch.Generator().manual_seed(seed)
        self.y = torch.arange(n) % 3
        r = torch.rand(n, generator=g)
        angle = 4 * r + self.y * (2 * math.pi / 3) + 0.2 * torch.randn(n, generator=g)
        self.X = torch.stack([r * torch.cos(angle), r * torch.sin(angle)], dim=1).to(dtype)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.X[i], self.y[i]


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 3))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--examples", type=int, default=1201)
    p.add_argument("--batch-size", type=int, default=64, help="the global batch, split over the workers")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--warmup-steps", type=int, default=10, help="steps over which the lr rises linearly to --lr")
    p.add_argument("--max-norm", type=float, default=1.0, help="clip the summed gradient's global norm to this")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for rank<r>.pt (parameters and optimizer state)")
    p.add_argument("--checkpoint-dir", default=None, help="save every epoch here; resume from it if present")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)

    world = phalanx.init()  # phalanx run, torchrun, or plain python: this worker's rank and device
    torch.manual_seed(args.seed)
    dp = phalanx.prepare(mlp(), world=world, dtype=dtype)  # a replica: rank 0's weights, broadcast
    optimizer = torch.optim.Adam(dp.module.parameters(), lr=args.lr)
    train = Spiral(args.examples, seed=1, dtype=dtype)
    test = Spiral(args.examples // 4 + 1, seed=2, dtype=dtype)
    loader = phalanx.ShardedLoader(train, world=world, global_batch_size=args.batch_size, seed=args.seed)
    warmup = args.warmup_steps  # the learning rate rises linearly over the first steps
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    start = phalanx.Position(epoch=0, step=0)
    if args.checkpoint_dir:
        start = phalanx.resume(args.checkpoint_dir, world=world, model=dp, optimizer=optimizer,
                               global_batch_size=args.batch_size, seed=args.seed, extras={"schedule": schedule},
                               loader=loader)
    clipped = steps = 0
    for epoch in range(start.epoch, args.epochs):
        for step, ((X, y), global_size) in enumerate(loader.epoch(epoch)):
            if epoch == start.epoch and step < start.step:
                continue  # a resumed run: these batches were trained before the checkpoint
            X, y = X.to(world.device), y.to(world.device)
            dp.zero_grad()
            loss_sum = F.cross_entropy(dp(X), y, reduction="sum")
            phalanx.shard_loss(loss_sum, global_size).backward()
            dp.finish_gradient_sync()  # every rank now holds the summed (1-device) gradient
            norm = phalanx.clip_grad_norm_(dp, args.max_norm)
            clipped, steps = clipped + int(norm > args.max_norm), steps + 1
            optimizer.step()
            schedule.step()
        sums = phalanx.evaluate_dataset(dp.module, test, world=world)  # every test point once
        if world.rank == 0:
            print(f"epoch {epoch + 1}  test loss {sums['loss'] / sums['count']:.4f}  "
                  f"test acc {sums['correct'] / sums['count']:.3f}", flush=True)
        if args.checkpoint_dir:
            phalanx.checkpoint(args.checkpoint_dir, world=world, model=dp, optimizer=optimizer, epoch=epoch + 1,
                               global_batch_size=args.batch_size, seed=args.seed, extras={"schedule": schedule},
                               loader=loader)
    if world.rank == 0:
        print(f"{world.world_size} worker(s), {steps} steps, clipped {clipped}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        torch.save({"params": {k: v.detach().cpu() for k, v in dp.module.state_dict().items()},
                    "optimizer": optimizer.state_dict()}, f"{args.out}/rank{world.rank}.pt")
    dp.close()


if __name__ == "__main__":
    main()
