"""DeepSpeed's CIFAR-10 tutorial (DeepSpeedExamples training/cifar), ported to phalanx, its
ds_config.json as the script's own lines.

    deepspeed --num_gpus 2 cifar10_deepspeed.py --deepspeed --deepspeed_config ds_config.json
    phalanx run --devices cpu:2 examples/deepspeed_cifar.py --zero-stage 2

Its network and its config's optimizer, warm-up, clipping, batch and ZeRO stage, on 28x28
grayscale IDX files from --data-dir (CIFAR-10 cannot be fetched here; offline: scikit-learn's
digits). What each DeepSpeed piece became:

    deepspeed.init_distributed()                -> world = phalanx.init()
    "train_batch_size": 16                      -> phalanx.ShardedLoader(global_batch_size=16): the same meaning
    "gradient_accumulation_steps": n            -> for piece in dp.accumulate(n): n batches of train_batch_size / n
    "zero_optimization": {"stage": s}           -> phalanx.prepare(shard="none" | "optimizer" | "gradients" | "parameters")
    "bf16": {"enabled": true}                   -> phalanx.prepare(precision="bf16-mixed")
    "optimizer": {"type": "Adam", ...}          -> dp.optimizer(torch.optim.Adam, lr=..., ...): a torch optimizer
    "scheduler": {"type": "WarmupLR", ...}      -> torch.optim.lr_scheduler.LambdaLR, the same ramp
    "gradient_clipping": 1.0                    -> phalanx.clip_grad_norm_(dp, 1.0): the global norm
    engine, optimizer, loader, _ = deepspeed.initialize(model=net, model_parameters=..., training_data=trainset)
                                                -> dp = phalanx.prepare(net, world=world, ...); the optimizer; the loader
    engine.backward(loss); engine.step()        -> phalanx.shard_loss(loss_sum, global_size).backward();
                                                   dp.finish_gradient_sync(); clip; optimizer.step(); scheduler.step()
    torch.distributed.barrier() around the download -> with phalanx.main_first(world=world): (not needed here)

Each stage and k workers end with the 1-device weights (float64: tests/distributed/test_examples.py).
"""

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import phalanx
from phalanx.data import load_dataset, to_float

SHARD = {0: "none", 1: "optimizer", 2: "gradients", 3: "parameters"}  # ZeRO's stage -> prepare's shard=


class Net(nn.Module):
    """The tutorial's network (PyTorch's CIFAR-10 one) for one 28x28 channel: 16*4*4 features, not 16*5*5."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.pool, self.conv2 = nn.Conv2d(1, 6, 5), nn.MaxPool2d(2, 2), nn.Conv2d(6, 16, 5)
        self.fc1, self.fc2, self.fc3 = nn.Linear(16 * 4 * 4, 120), nn.Linear(120, 84), nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x))).flatten(1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # ds_config.json's keys, as flags
    p.add_argument("--train-batch-size", type=int, default=16, help="the global batch, as DeepSpeed's")
    p.add_argument("--gradient-accumulation-steps", type=int, default=1)
    p.add_argument("--zero-stage", type=int, default=0, choices=sorted(SHARD))
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--lr", type=float, default=0.001)
    p.add_argument("--warmup-num-steps", type=int, default=1000)
    p.add_argument("--gradient-clipping", type=float, default=1.0)
    # the script's own
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--out", default=None, help="rank 0 writes the final state_dict here")
    args = p.parse_args()
    n = args.gradient_accumulation_steps
    if n < 1 or args.train_batch_size % n:
        p.error(f"--train-batch-size {args.train_batch_size} is n micro-batches a step: it must be a multiple of "
                f"--gradient-accumulation-steps {n} (at least 1)")
    dtype = getattr(torch, args.dtype)

    world = phalanx.init()
    data = load_dataset(None, args.data_dir, log=world.print)
    # the tutorial's Normalize((0.5,), (0.5,)): [0, 1] -> [-1, 1]
    trainset = TensorDataset(to_float(data.train_images, dtype) * 2 - 1, data.train_labels)
    testset = TensorDataset(to_float(data.test_images, dtype) * 2 - 1, data.test_labels)

    torch.manual_seed(0)
    dp = phalanx.prepare(Net(), world=world, dtype=dtype, shard=SHARD[args.zero_stage],
                         precision="bf16-mixed" if args.bf16 else None)
    world.print(dp.choices.describe())
    # "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}}
    optimizer = dp.optimizer(torch.optim.Adam, lr=args.lr, betas=(0.8, 0.999), eps=1e-8, weight_decay=3e-7)
    # "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": lr, "warmup_num_steps": n}}:
    # DeepSpeed's default warm-up is log-shaped, log(step + 1) / log(n), then flat
    warmup = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, math.log(step + 1) / math.log(args.warmup_num_steps)))
    # DeepSpeed's train_batch_size is a step's: n micro-batches of train_batch_size / n, split over the ranks
    loader = phalanx.ShardedLoader(trainset, world=world, global_batch_size=args.train_batch_size // n, seed=0)
    for epoch in range(args.epochs):
        batches = loader.epoch(epoch)
        # n micro-batches a step, as DeepSpeed's engine steps (zip leaves out a last group of fewer)
        for step_batches in zip(*[batches] * n):
            optimizer.zero_grad()
            step_size = sum(global_size for _, global_size in step_batches)  # the mean over the step's n batches
            for _, ((inputs, labels), _) in zip(dp.accumulate(n), step_batches):
                loss_sum = F.cross_entropy(dp(inputs.to(world.device)), labels.to(world.device), reduction="sum")
                phalanx.shard_loss(loss_sum, step_size).backward()
            dp.finish_gradient_sync()
            phalanx.clip_grad_norm_(dp, args.gradient_clipping)
            optimizer.step()
            warmup.step()
        sums = phalanx.evaluate_dataset(dp.module, testset, world=world, batch_size=1000)
        world.print(f"epoch {epoch + 1}  test loss {sums['loss'] / sums['count']:.4f}  "
                    f"accuracy {100 * sums['correct'] / sums['count']:.2f}%")
    state = dp.full_state_dict() if args.zero_stage == 3 else dp.state_dict()  # stage 3 gathers its shards
    if args.out and world.rank == 0:
        torch.save(state, args.out)
    dp.close()


if __name__ == "__main__":
    main()
