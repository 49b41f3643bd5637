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

import importlib
import sys

# Each public name's module is imported on first use (PEP 562): `import phalanx` then loads no torch,
# so the `phalanx` command (phalanx/__main__.py) installs its Ctrl-C and SIGTERM handlers before
# torch's second of importing, and a Ctrl-C then is one line. The table: public_names.py.
from phalanx.public_names import OWNERS as _OWNERS

__version__ = "0.1.0"

__all__ = [
    "BatchRandom", "DataParallel", "DataParallelConfig", "MetricsLogger", "PhalanxWarning", "Position", "RunFailed",
    "ShardedLoader", "UsageError", "VerifyConfig", "World", "allreduce", "barrier", "broadcast", "capture_step",
    "checkpoint", "clip_grad_norm_", "clip_grad_value_", "convert_sync_batchnorm", "evaluate", "evaluate_dataset", "gather",
    "global_batches", "init", "launch", "main_first", "prepare", "progress", "rank_shard", "reduce", "resume", "shard_loss",
    "shard_sizes", "split_batch", "stop_requested", "train_batch",
]


def __getattr__(name: str):
    owner = _OWNERS.get(name)
    if owner is None:  # hvd.rank(), deepspeed.initialize, fabric.save as phalanx.save: phalanx's way, in one line
        from phalanx.runtime.foreign_names import FOREIGN_NAMES
        from phalanx.runtime.horovod_deepspeed import module_name_error
        raise module_name_error(name, asker=sys._getframe(1), also=FOREIGN_NAMES)
    value = getattr(importlib.import_module(owner), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    """The public names and the module's dunders (what a notebook's completion offers): not the helpers
    this file imports (importlib, sys) nor the subpackages imported so far."""
    return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})
