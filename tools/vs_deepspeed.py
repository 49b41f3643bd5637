"""phalanx against DeepSpeed on CPU workers, side by side: the same training and the same allreduce.

    pip install deepspeed            # not a phalanx dependency; its CPU accelerator: DS_ACCELERATOR=cpu
    python tools/vs_deepspeed.py --data-dir DIR --workers 2 --rounds 3

Training: DeepSpeed's CIFAR-10 tutorial network (examples/deepspeed_cifar.py's Net) on DIR's
28x28 IDX images with the tutorial's config (Adam, WarmupLR, clipping 1.0), at each --batches
global batch and ZeRO --stages: DeepSpeed's engine (deepspeed.initialize, engine.backward,
engine.step) against examples/deepspeed_cifar.py's phalanx loop, both started by torchrun
--nproc-per-node W, and one plain process (no launcher, torch's threads) for reference. Each run
prints seconds per epoch; the epochs after the first are kept, the median over --rounds rounds
taken, and the contenders run interleaved within each round. Allreduce: phalanx's shm allreduce,
torch's gloo all_reduce and deepspeed.comm.all_reduce (what DeepSpeed's engine sums gradients
with on CPU), interleaved in one torchrun job by phalanx's collective timer (slowest rank).
Prints the tables; writes nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARD = {0: "none", 1: "optimizer", 2: "gradients", 3: "parameters"}


def _data(data_dir: str):
    import torch

    from phalanx.data import load_dataset, to_float
    data = load_dataset(None, data_dir, log=lambda _: None)
    return torch.utils.data.TensorDataset(to_float(data.train_images) * 2 - 1, data.train_labels)


def _deepspeed_worker(args) -> None:
    import deepspeed
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, str(REPO / "examples"))
    from deepspeed_cifar import Net

    deepspeed.init_distributed()
    trainset = _data(args.data_dir)
    torch.manual_seed(0)
    net = Net()
    config = {"train_batch_size": args.batch, "gradient_clipping": 1.0, "steps_per_print": 10**9,
              "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                      "weight_decay": 3e-7, "torch_adam": True}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                           "warmup_num_steps": 1000}},
              "zero_optimization": {"stage": args.stage}}
    engine, _, loader, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), training_data=trainset,
                                                config=config)
    for _ in range(args.epochs):
        start = time.perf_counter()
        for x, y in loader:
            engine.backward(F.cross_entropy(engine(x), y))
            engine.step()
        if engine.global_rank == 0:
            print(f"epoch_s {time.perf_counter() - start:.4f}", flush=True)


def _phalanx_worker(args) -> None:
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, str(REPO / "examples"))
    from deepspeed_cifar import Net

    import phalanx
    world = phalanx.init()
    trainset = _data(args.data_dir)
    torch.manual_seed(0)
    dp = phalanx.prepare(Net(), world=world, shard=SHARD[args.stage])
    optimizer = dp.optimizer(torch.optim.Adam, lr=0.001, betas=(0.8, 0.999), eps=1e-8, weight_decay=3e-7)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, math.log(step + 1) / math.log(1000)))
    loader = phalanx.ShardedLoader(trainset, world=world, global_batch_size=args.batch, seed=0)
    for epoch in range(args.epochs):
        start = time.perf_counter()
        for (x, y), global_size in loader.epoch(epoch):
            optimizer.zero_grad()
            phalanx.shard_loss(F.cross_entropy(dp(x), y, reduction="sum"), global_size).backward()
            dp.finish_gradient_sync()
            phalanx.clip_grad_norm_(dp, 1.0)
            optimizer.step()
            warmup.step()
        world.print(f"epoch_s {time.perf_counter() - start:.4f}")
    dp.close()


def _allreduce_worker(args) -> None:
    import deepspeed
    import deepspeed.comm as ds_comm
    import torch
    import torch.distributed as dist

    import phalanx
    from phalanx.comm import AsyncComm
    from phalanx.measure.collective import time_collectives
    world = phalanx.init()
    deepspeed.init_distributed()
    comm = AsyncComm(world=world, algorithms=("shm",), threaded=False)
    calls = {}
    for size in (4 << 10, 64 << 10, 512 << 10, 4 << 20):
        buffer = torch.zeros(size // 4)
        calls[(size, "phalanx shm")] = lambda b=buffer: comm.allreduce(b, algorithm="shm")
        calls[(size, "gloo")] = lambda b=buffer: dist.all_reduce(b)
        calls[(size, "deepspeed.comm")] = lambda b=buffer: ds_comm.all_reduce(b)
    samples = time_collectives(calls, rounds=args.rounds, warmup_calls=20)["samples"]
    medians = torch.tensor([statistics.median(samples[key]) for key in calls], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # a collective is done when its slowest rank is
    if world.rank == 0:
        seconds = dict(zip(calls, medians.tolist()))
        print(f"{'size':>8}  {'phalanx shm':>12}  {'gloo':>12}  {'deepspeed.comm':>15}  deepspeed / phalanx")
        for size in sorted({size for size, _ in calls}):
            mine, gloo, ds = (seconds[(size, name)] for name in ("phalanx shm", "gloo", "deepspeed.comm"))
            print(f"{size >> 10:>5} KB  {mine * 1e6:>9.1f} us  {gloo * 1e6:>9.1f} us  {ds * 1e6:>12.1f} us  "
                  f"{ds / mine:>6.1f}x")
    comm.close()


def _epoch_s(command: list[str], env: dict) -> float:
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    times = [float(t) for t in re.findall(r"^epoch_s ([0-9.]+)$", done.stdout, re.M)]
    if done.returncode != 0 or len(times) < 2:
        sys.exit(f"vs_deepspeed: {' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return statistics.median(times[1:])  # the first epoch pays warm-up


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", required=True, help="28x28 IDX images (Fashion-MNIST's four files)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batches", default="16,256")
    p.add_argument("--stages", default="0,2")
    p.add_argument("--worker", choices=["deepspeed", "phalanx", "allreduce"], help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=16, help=argparse.SUPPRESS)
    p.add_argument("--stage", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        {"deepspeed": _deepspeed_worker, "phalanx": _phalanx_worker, "allreduce": _allreduce_worker}[args.worker](args)
        return
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.workers)]
    me = [str(Path(__file__).resolve()), "--data-dir", args.data_dir, "--epochs", str(args.epochs)]
    print(f"s/epoch (median of {args.rounds} rounds, epochs after the first), {args.workers} workers by torchrun")
    print(f"{'batch':>5} {'ZeRO':>4}  {'DeepSpeed':>9}  {'phalanx':>8}  {'1 process':>9}  DeepSpeed / phalanx")
    for batch in map(int, args.batches.split(",")):
        for stage in map(int, args.stages.split(",")):
            runs: dict[str, list[float]] = {"deepspeed": [], "phalanx": [], "one": []}
            flags = ["--batch", str(batch), "--stage", str(stage)]
            for _ in range(args.rounds):  # interleaved: a noisy minute hits every contender
                runs["deepspeed"].append(_epoch_s([*torchrun, *me, "--worker", "deepspeed", *flags], env))
                runs["phalanx"].append(_epoch_s([*torchrun, *me, "--worker", "phalanx", *flags], env))
                runs["one"].append(_epoch_s([sys.executable, *me, "--worker", "phalanx", *flags], env))
            ds, mine, one = (statistics.median(runs[k]) for k in ("deepspeed", "phalanx", "one"))
            print(f"{batch:>5} {stage:>4}  {ds:>9.3f}  {mine:>8.3f}  {one:>9.3f}  {ds / mine:>6.2f}x", flush=True)
    subprocess.run([*torchrun, *me, "--worker", "allreduce", "--rounds", str(args.rounds)], env=env, check=True,
                   timeout=900)


if __name__ == "__main__":
    main()
