"""Parallelism strategies. Data parallelism: full replicas, split batches, summed gradients."""

from phalanx.parallel.buckets import Bucket, build_buckets
from phalanx.parallel.data_parallel import DataParallel

__all__ = ["Bucket", "build_buckets", "DataParallel"]
