"""Training: the loop (`train_batch`, `train_epoch` over any `Strategy`), evaluation on all devices, outputs."""

from phalanx.train.config import DATASETS, TrainConfig
from phalanx.train.evaluate import evaluate
from phalanx.train.loop import DataSplit, EpochStats, Strategy, train_batch, train_epoch

__all__ = ["DATASETS", "TrainConfig", "evaluate", "DataSplit", "EpochStats", "Strategy", "train_batch", "train_epoch"]
