"""Each public name of `phalanx` and the module that owns it: a table of strings, importing nothing.

The front door (phalanx/__init__.py) imports a name's module on its first use (PEP 562), so `import
phalanx` loads no torch and the `phalanx` command installs its Ctrl-C and SIGTERM handlers before
torch's second of importing. `phalanx.launch` imports every module here before it forks
(runtime/forked.py `warm_imports`), so its workers find them loaded instead of importing them anew
on each launch. Both read this table, which sits below every other part.
"""

OWNERS = {
    "allreduce": "phalanx.comm", "BatchRandom": "phalanx.data_parallel.batch_random",
    "barrier": "phalanx.comm.gather", "broadcast": "phalanx.comm.gather",
    "gather": "phalanx.comm.gather", "main_first": "phalanx.comm.gather",
    "ShardedLoader": "phalanx.train.sharded_loader",
    "global_batches": "phalanx.data.split", "rank_shard": "phalanx.data.split", "shard_sizes": "phalanx.data.split",
    "split_batch": "phalanx.data.split",
    "PhalanxWarning": "phalanx.errors", "RunFailed": "phalanx.errors", "UsageError": "phalanx.errors",
    "clip_grad_norm_": "phalanx.data_parallel.clip", "clip_grad_value_": "phalanx.data_parallel.clip",
    "DataParallel": "phalanx.data_parallel.data_parallel", "DataParallelConfig": "phalanx.data_parallel.config",
    "prepare": "phalanx.data_parallel.prepare",
    "convert_sync_batchnorm": "phalanx.data_parallel.sync_batchnorm",
    "init": "phalanx.runtime.script", "launch": "phalanx.runtime.function_launch",
    "MetricsLogger": "phalanx.telemetry.run_log", "progress": "phalanx.telemetry.run_log",
    "Position": "phalanx.train.checkpoint", "checkpoint": "phalanx.train.script_checkpoint",
    "resume": "phalanx.train.script_checkpoint",
    "evaluate": "phalanx.train.evaluate", "evaluate_dataset": "phalanx.train.evaluate",
    "shard_loss": "phalanx.data_parallel.step", "train_batch": "phalanx.train.loop",
    "capture_step": "phalanx.train.graphs",
    "reduce": "phalanx.train.metrics", "stop_requested": "phalanx.train.stopping",
    "VerifyConfig": "phalanx.verify.config",
    "World": "phalanx.runtime.world",
}
