"""Training: the loop (`train_batch`, `train_epoch`), evaluation on all devices, outputs."""

from phalanx.train.config import DATASETS, TrainConfig
from phalanx.train.evaluate import evaluate
from phalanx.train.loop import EpochStats, train_batch, train_epoch

__all__ = ["DATASETS", "TrainConfig", "evaluate", "EpochStats", "train_batch", "train_epoch"]
