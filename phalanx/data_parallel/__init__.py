"""Data parallelism: a full replica on every rank, each rank its split of the batch, gradients summed.

`prepare` (prepare.py) makes a user's model such a replica, a `DataParallel` (data_parallel.py:
broadcast, buckets, overlap, no_sync); `sharding/` keeps 1/k per rank of its state (ZeRO 1-3);
`guards/` turns silent failures and DDP habits into errors and notices. The model splits (layers,
channels) are phalanx/model_split/'s."""

from phalanx.data_parallel.buckets import Bucket, build_buckets
from phalanx.data_parallel.config import DEFAULT_BUCKET_CAP_MB, GRAD_DTYPES, DataParallelConfig
from phalanx.data_parallel.data_parallel import DataParallel
from phalanx.data_parallel.memory_format import MEMORY_FORMATS, apply_memory_format, format_name, resolve_memory_format
from phalanx.data_parallel.overlap import OverlapScheduler
from phalanx.data_parallel.choices import Choices
from phalanx.data_parallel.prepare import prepare, prepare_replica
from phalanx.data_parallel.guards.running_stats import average_running_stats
from phalanx.data_parallel.sync_batchnorm import BATCHNORM_POLICIES, SyncBatchNorm, convert_sync_batchnorm, has_sync_batchnorm

__all__ = ["Bucket", "build_buckets", "DEFAULT_BUCKET_CAP_MB", "GRAD_DTYPES", "DataParallel",
           "DataParallelConfig", "OverlapScheduler", "MEMORY_FORMATS", "Choices", "prepare", "prepare_replica",
           "apply_memory_format", "format_name", "resolve_memory_format", "BATCHNORM_POLICIES", "SyncBatchNorm",
           "average_running_stats", "convert_sync_batchnorm", "has_sync_batchnorm"]
