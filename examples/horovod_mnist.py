"""Horovod's MNIST example (examples/pytorch/pytorch_mnist.py), ported to phalanx line by line.

    horovodrun -np 2 python pytorch_mnist.py            # Horovod
    phalanx run --devices cpu:2 examples/horovod_mnist.py --data-dir data/mnist

Its network, optimizer and defaults, on MNIST-format IDX files from --data-dir (MNIST or
Fashion-MNIST; offline without it: scikit-learn's digits). What each Horovod line became:

    hvd.init(); hvd.rank(), hvd.size()          -> world = phalanx.init(); world.rank, world.world_size
    torch.set_num_threads(1)                    -> dropped: phalanx run gives each worker its share of the cores
    DistributedSampler(num_replicas=hvd.size()) -> phalanx.ShardedLoader(global_batch_size=B): no padding
    + DataLoader(batch_size=b) per worker          (--batch-size is the global batch, as on one device)
    lr * hvd.size()                             -> lr as on one device, for the same global batch
    hvd.broadcast_parameters, _optimizer_state  -> phalanx.prepare broadcasts rank 0's state
    hvd.DistributedOptimizer(compression=fp16)  -> phalanx.prepare(grad_dtype="fp16"), the optimizer as it is
    F.nll_loss(output, target); loss.backward() -> phalanx.shard_loss(the sum, global_size).backward()
    optimizer.step() (it synchronizes)          -> dp.finish_gradient_sync(); optimizer.step()
    metric_average(hvd.allreduce(...))          -> phalanx.evaluate_dataset: sums over the whole test set
    if hvd.rank() == 0: print(...)              -> world.print(...)

With --dropout 0, k workers end with the 1-device weights (float64: tests/distributed/test_examples.py);
with Horovod's dropout each rank draws its own masks.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import phalanx
from phalanx.data import load_dataset, to_float


class Net(nn.Module):
    """Horovod's MNIST network: two 5x5 convolutions, dropout, two linear layers, log-probabilities."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d(dropout)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        x = F.dropout(x, p=self.dropout, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=64, help="the global batch (Horovod's was per worker)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--fp16-allreduce", action="store_true", help="send the gradients as float16")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--out", default=None, help="rank 0 writes the final state_dict here")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)

    world = phalanx.init()
    data = load_dataset(None, args.data_dir, log=world.print)  # 28x28 IDX files, or the digits offline
    # Horovod's transforms: ToTensor, then Normalize((0.1307,), (0.3081,))
    train = TensorDataset((to_float(data.train_images, dtype) - 0.1307) / 0.3081, data.train_labels)
    test = TensorDataset((to_float(data.test_images, dtype) - 0.1307) / 0.3081, data.test_labels)

    torch.manual_seed(args.seed)
    dp = phalanx.prepare(Net(args.dropout), world=world, dtype=dtype,
                         grad_dtype="fp16" if args.fp16_allreduce else None)
    world.print(dp.choices.describe())
    optimizer = torch.optim.SGD(dp.parameters(), lr=args.lr, momentum=args.momentum)
    loader = phalanx.ShardedLoader(train, world=world, global_batch_size=args.batch_size, seed=args.seed)
    for epoch in range(args.epochs):
        dp.train()
        for (data_, target), global_size in loader.epoch(epoch):
            dp.zero_grad()
            loss_sum = F.nll_loss(dp(data_.to(world.device)), target.to(world.device), reduction="sum")
            phalanx.shard_loss(loss_sum, global_size).backward()
            dp.finish_gradient_sync()
            optimizer.step()
        dp.eval()
        sums = phalanx.evaluate_dataset(dp.module, test, world=world, batch_size=1000)
        world.print(f"epoch {epoch + 1}  test loss {sums['loss'] / sums['count']:.4f}  "
                    f"accuracy {100 * sums['correct'] / sums['count']:.2f}%")
    if args.out and world.rank == 0:
        torch.save(dp.state_dict(), args.out)
    dp.close()


if __name__ == "__main__":
    main()
