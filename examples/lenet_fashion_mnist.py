"""The chapter's LeNet on Fashion-MNIST (D2L "Training on Multiple GPUs"), written with phalanx's API.

    phalanx run --devices cpu:2 examples/lenet_fashion_mnist.py --epochs 10
    phalanx run --devices cuda:0,1 examples/lenet_fashion_mnist.py --data-dir data/fashion-mnist

`phalanx train` does the same with more switches; this is what a user writes. Fashion-MNIST comes
from --data-dir, or phalanx's verified download cache (offline: scikit-learn's digits instead).
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import phalanx
from phalanx.data import load_dataset, to_float


def lenet() -> nn.Module:
    """The book's variant: conv 1->20 3x3, avg-pool; conv 20->50 5x5, avg-pool; 800->128->10."""
    return nn.Sequential(nn.Conv2d(1, 20, 3), nn.ReLU(), nn.AvgPool2d(2), nn.Conv2d(20, 50, 5), nn.ReLU(),
                         nn.AvgPool2d(2), nn.Flatten(), nn.Linear(800, 128), nn.ReLU(), nn.Linear(128, 10))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=256, help="the global batch")
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--out", default=None, help="rank 0 writes the final state_dict here")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)

    world = phalanx.init()
    data = load_dataset(None, args.data_dir, log=print if world.rank == 0 else (lambda _: None))
    train = TensorDataset(to_float(data.train_images, dtype), data.train_labels)
    test = TensorDataset(to_float(data.test_images, dtype), data.test_labels)
    torch.manual_seed(0)
    dp = phalanx.prepare(lenet(), world=world, dtype=dtype)  # on CPU a conv net runs in channels_last
    if world.rank == 0:
        print(dp.choices.describe(), flush=True)
    optimizer = torch.optim.SGD(dp.module.parameters(), lr=args.lr)
    loader = phalanx.ShardedLoader(train, world=world, global_batch_size=args.batch_size, seed=0)
    for epoch in range(args.epochs):
        for (X, y), global_size in loader.epoch(epoch):
            dp.zero_grad()
            loss_sum = F.cross_entropy(dp(X.to(world.device)), y.to(world.device), reduction="sum")
            phalanx.shard_loss(loss_sum, global_size).backward()
            dp.finish_gradient_sync()
            optimizer.step()
        train_sums = phalanx.evaluate_dataset(dp.module, train, world=world, batch_size=1024)
        test_sums = phalanx.evaluate_dataset(dp.module, test, world=world, batch_size=1024)
        if world.rank == 0:
            print(f"epoch {epoch + 1}  train loss {train_sums['loss'] / train_sums['count']:.4f}  "
                  f"test acc {test_sums['correct'] / test_sums['count']:.3f}", flush=True)
    if args.out and world.rank == 0:
        torch.save(dp.module.state_dict(), args.out)
    dp.close()


if __name__ == "__main__":
    main()
