"""Training as a library: the step and the epoch over any `Strategy`, evaluation on all devices, checkpoints.

What a user's own loop and phalanx's own commands share; the `phalanx train` job itself (its
config, outputs, restarts) is job/.
"""

from phalanx.train.evaluate import evaluate
from phalanx.train.loop import EpochStats, Strategy, train_batch, train_epoch, train_step

__all__ = ["evaluate", "EpochStats", "Strategy", "train_batch", "train_epoch", "train_step"]
