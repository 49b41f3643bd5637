"""phalanx: train one model on k devices in lockstep (data parallelism from first principles).

The public vocabulary follows Dive into Deep Learning's "Training on Multiple GPUs":
`split_batch`, `allreduce`, `train_batch`, `evaluate`.
"""

__version__ = "0.1.0"
