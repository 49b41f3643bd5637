"""Parallelism strategies. Data parallelism: full replicas, split batches, summed gradients;
`prepare` makes a user's model such a replica; the model splits (pipeline, channels) live in splits.py."""

from phalanx.data_parallel.buckets import Bucket, build_buckets
from phalanx.data_parallel.data_parallel import DEFAULT_BUCKET_CAP_MB, GRAD_DTYPES, DataParallel
from phalanx.data_parallel.memory_format import MEMORY_FORMATS, apply_memory_format, format_name, resolve_memory_format
from phalanx.data_parallel.overlap import OverlapScheduler
from phalanx.data_parallel.choices import Choices
from phalanx.data_parallel.prepare import prepare
from phalanx.data_parallel.running_stats import average_running_stats
from phalanx.data_parallel.sync_batchnorm import BATCHNORM_POLICIES, SyncBatchNorm, convert_sync_batchnorm, has_sync_batchnorm

__all__ = ["Bucket", "build_buckets", "DEFAULT_BUCKET_CAP_MB", "GRAD_DTYPES", "DataParallel", "OverlapScheduler", "MEMORY_FORMATS",
           "Choices", "prepare",
           "apply_memory_format", "format_name", "resolve_memory_format", "BATCHNORM_POLICIES", "SyncBatchNorm",
           "average_running_stats", "convert_sync_batchnorm", "has_sync_batchnorm"]
