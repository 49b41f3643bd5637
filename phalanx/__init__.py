"""phalanx: train one model on k devices in lockstep (data parallelism from first principles).

The public vocabulary follows Dive into Deep Learning's "Training on Multiple GPUs":
`split_batch`, `allreduce`, `train_batch`, `evaluate`. This file is the front door for a user's
own script (run it with `phalanx run --devices cpu:3 script.py`, under torchrun, or alone):
each name below is re-exported from the module that owns it.

    world = phalanx.init()                                   # rank, world size, device
    dp = phalanx.prepare(model, world=world)                 # replica (an nn.Module): rank 0's state, layout, exchange
    optimizer = torch.optim.SGD(dp.parameters(), lr=0.1)
    loader = phalanx.ShardedLoader(dataset, world=world, global_batch_size=64, seed=0)
    for batch, global_size in phalanx.progress(loader.epoch(epoch), world=world, total=len(loader)):
        dp.zero_grad()
        loss = phalanx.shard_loss(loss_sum(dp(X), y), global_size)   # this rank's share of the mean
        loss.backward()
        dp.finish_gradient_sync()                            # every rank: the summed gradient
        phalanx.clip_grad_norm_(dp, 1.0)                     # the global norm
        optimizer.step()
    world.print("loss", phalanx.reduce(loss, op="sum", world=world))  # rank 0 prints the global mean

`docs/ddp.md` maps a DDP script onto these names, and says what phalanx does about each habit.
"""

from phalanx.comm import allreduce
from phalanx.data.loader import ShardedLoader
from phalanx.data.split import global_batches, rank_shard, shard_sizes, split_batch
from phalanx.errors import PhalanxWarning, RunFailed, UsageError
from phalanx.parallel.clip import clip_grad_norm_
from phalanx.parallel.data_parallel import DataParallel
from phalanx.parallel.prepare import prepare
from phalanx.parallel.sync_batchnorm import convert_sync_batchnorm
from phalanx.script import init
from phalanx.telemetry.run_log import MetricsLogger, progress
from phalanx.train.checkpoint import Position, checkpoint, resume
from phalanx.train.evaluate import evaluate, evaluate_dataset
from phalanx.train.loop import shard_loss, train_batch
from phalanx.train.metrics import reduce
from phalanx.verify.config import VerifyConfig
from phalanx.world import World

__version__ = "0.1.0"

__all__ = [
    "DataParallel", "MetricsLogger", "PhalanxWarning", "Position", "RunFailed", "ShardedLoader", "UsageError",
    "VerifyConfig", "World", "allreduce", "checkpoint", "clip_grad_norm_", "convert_sync_batchnorm", "evaluate",
    "evaluate_dataset", "global_batches", "init", "prepare", "progress", "rank_shard", "reduce", "resume",
    "shard_loss", "shard_sizes", "split_batch", "train_batch",
]
