"""A user Dataset that reads its examples from files lazily: each rank opens only its own shard's files.

    phalanx run --devices cpu:2 examples/lazy_files.py --make-data data/points --epochs 5
    phalanx run --devices cpu:2 examples/lazy_files.py --data data/points --loader-workers 2

One example per file (`<index>.txt`: the label, then the features, comma-separated), found by
listing the directory and read only in `__getitem__`, so memory holds file names, not the data:
the shape of image folders, audio clips or documents. `ShardedLoader` hands each rank only the
indices of its shards, so a rank opens only its own files (each rank prints how many it read),
besides a few read to check that every rank lists the same set (the first global batch's first 8,
once, and the first 8 files when evaluating);
`--loader-workers N` reads them in N DataLoader worker processes.
`--make-data DIR` first writes a generated set there (rank 0 writes, the others wait for it).
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import phalanx


class FileDataset(torch.utils.data.Dataset):
    """Every `*.txt` in `root`, one example each, read when asked for."""

    def __init__(self, root: Path) -> None:
        self.files = sorted(root.glob("*.txt"), key=lambda p: int(p.stem))
        self.reads = 0  # files opened in this process (with loader workers: in the workers)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        self.reads += 1
        label, *features = self.files[i].read_text().strip().split(",")
        return torch.tensor([float(f) for f in features], dtype=torch.float64), int(label)


def make_data(root: Path, n: int, features: int = 8, classes: int = 4) -> None:
    """`n` files of Gaussian points around `classes` fixed centres."""
    g = torch.Generator().manual_seed(0)
    centres = 2 * torch.randn(classes, features, generator=g)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        label = i % classes
        x = centres[label] + torch.randn(features, generator=g)
        tmp = root / f".{i}.tmp"
        tmp.write_text(",".join([str(label), *(f"{v:.6f}" for v in x.tolist())]) + "\n")
        tmp.rename(root / f"{i}.txt")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None, help="directory of example files")
    p.add_argument("--make-data", default=None, metavar="DIR", help="generate --examples files in DIR, then train")
    p.add_argument("--examples", type=int, default=500)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--loader-workers", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for rank<r>.pt (this rank's parameters)")
    args = p.parse_args()

    world = phalanx.init()
    root = Path(args.make_data or args.data or "data/points")
    if args.make_data and world.rank == 0:
        make_data(root, args.examples)
    phalanx.allreduce(torch.zeros(1), world=world)  # a barrier: rank 0's files exist before anyone lists them
    dataset = FileDataset(root)
    torch.manual_seed(0)
    dp = phalanx.prepare(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)), world=world, dtype="float64")
    optimizer = torch.optim.SGD(dp.module.parameters(), lr=args.lr, momentum=0.9)
    loader = phalanx.ShardedLoader(dataset, world=world, global_batch_size=args.batch_size, seed=0,
                                   num_workers=args.loader_workers)
    for epoch in range(args.epochs):
        for (X, y), global_size in loader.epoch(epoch):
            dp.zero_grad()
            phalanx.shard_loss(F.cross_entropy(dp(X), y, reduction="sum"), global_size).backward()
            dp.finish_gradient_sync()
            optimizer.step()
    sums = phalanx.evaluate_dataset(dp.module, dataset, world=world, batch_size=128)
    read_in_loop = dataset.reads if args.loader_workers == 0 else "n/a (read in loader workers)"
    # One write per line: every rank prints, and under PYTHONUNBUFFERED print() issues the text and
    # its newline as two writes, so two ranks' lines could run together.
    sys.stdout.write(f"rank {world.rank}: {len(dataset)} files listed, {read_in_loop} reads\n")
    sys.stdout.flush()
    if world.rank == 0:
        print(f"train acc {sums['correct'] / sums['count']:.3f} after {args.epochs} epochs", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        torch.save(dp.module.state_dict(), f"{args.out}/rank{world.rank}.pt")
    dp.close()


if __name__ == "__main__":
    main()
