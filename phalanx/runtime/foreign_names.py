"""What Accelerate's `Accelerator` and Lightning Fabric's `Fabric` call what phalanx calls
otherwise, for the `World` a script holds where it held one of those: a name asked of it that
phalanx spells differently is an AttributeError naming phalanx's way in one line (docs/accelerate-fabric.md),
not Python's bare "has no attribute". Names that already mean the same (`device`, `local_rank`,
`world_size`, `node_rank`, `print`) are World's own and never come here. `DDP_KEYWORDS` does the
same for what a DDP user hands `prepare` where they handed `DistributedDataParallel(...)`, and
`DDP_METHODS` for what they call on the replica where they called it on DDP's wrapper; with
Horovod's and DeepSpeed's (horovod_deepspeed.py) they make prepare's TypeError and the replica's
AttributeError. What another tool hands a phalanx function (its keywords, its order of arguments,
the World by position) is call_habits.py's.
"""

from __future__ import annotations

from phalanx.runtime.horovod_deepspeed import ENGINE_METHODS, KEYWORDS as HOROVOD_DEEPSPEED_KEYWORDS

ACCELERATE, FABRIC, _BOTH = "Accelerate's", "Fabric's", "Accelerate's and Fabric's"

# Ways more than one name is given.
TRACKER_WAY = "phalanx.MetricsLogger(out_dir, world=world)"
CALLBACKS_WAY = "no callbacks: call the functions themselves in the loop (rank 0's alone: if world.is_main: ...)"
_OPTIMIZER_AS_IS = "the optimizer over dp.parameters(), as it is (with shard=: dp.optimizer(cls, ...))"
_TRIGGER = "phalanx.reduce(float(flag), op='sum', world=world) > 0: whether any rank set it"
_SAME_BATCH_COUNT = "not needed with phalanx.ShardedLoader, which gives every rank the same number of batches"
_UNUSED_FOUND = "not needed: a parameter no rank's backward reached keeps no gradient, as on one device"
_WORLD_GROUP = "the world's group: phalanx.init() joins or adopts it"
_BACKWARD_ORDER = "the buckets go out in backward's order; overlap=False exchanges all of them after backward"

# name -> (whose, phalanx's way)
FOREIGN_NAMES: dict[str, tuple[str, str]] = {
    "is_main_process": (ACCELERATE, "world.is_main"),
    "is_local_main_process": (ACCELERATE, "world.local_rank == 0"),
    "is_global_zero": (FABRIC, "world.is_main"),
    "process_index": (ACCELERATE, "world.rank"),
    "num_nodes": ("Lightning's and Fabric's strategy", "world.world_size // world.local_world_size hosts, where each "
                                                      "runs world.local_world_size workers (torchrun --nnodes H "
                                                      "--nproc-per-node N); world.node_rank is this rank's host"),
    "global_rank": (FABRIC, "world.rank"),
    "local_process_index": (ACCELERATE, "world.local_rank"),
    "num_processes": (ACCELERATE, "world.world_size"),
    "wait_for_everyone": (ACCELERATE, "phalanx.barrier(world=world)"),
    "barrier": (FABRIC, "phalanx.barrier(world=world)"),
    "gather": (ACCELERATE, "phalanx.gather(tensor, world=world): every rank's rows in rank order"),
    "gather_for_metrics": (ACCELERATE, "phalanx.gather(tensor, world=world): no padding to drop, the rows are "
                                       "the global batch's"),
    "all_gather": (FABRIC, "phalanx.gather(tensor, world=world), concatenated along dim 0 (not stacked)"),
    "reduce": (ACCELERATE, "phalanx.reduce(value, op='mean', world=world)"),
    "all_reduce": (FABRIC, "phalanx.reduce(value, op='mean', world=world)"),
    "broadcast": (FABRIC, "phalanx.broadcast(obj, src=0, world=world) (prepare broadcasts rank 0's weights itself)"),
    "prepare": (ACCELERATE, "dp = phalanx.prepare(model, world=world); the optimizer over dp.parameters(); "
                            "phalanx.ShardedLoader for the data"),
    "setup": (FABRIC, "dp = phalanx.prepare(model, world=world); the optimizer over dp.parameters()"),
    "setup_module": (FABRIC, "dp = phalanx.prepare(model, world=world)"),
    "setup_dataloaders": (FABRIC, "phalanx.ShardedLoader(dataset, world=world, global_batch_size=...)"),
    "prepare_data_loader": (ACCELERATE, "phalanx.ShardedLoader(dataset, world=world, global_batch_size=...)"),
    "backward": (_BOTH, "phalanx.shard_loss(loss_sum, global_size).backward(), then dp.finish_gradient_sync()"),
    "clip_grad_norm_": (ACCELERATE, "phalanx.clip_grad_norm_(dp, max_norm), after dp.finish_gradient_sync()"),
    "clip_gradients": (FABRIC, "phalanx.clip_grad_norm_(dp, max_norm), after dp.finish_gradient_sync()"),
    "accumulate": (ACCELERATE, "for piece in dp.accumulate(n): ..."),
    "sync_gradients": (ACCELERATE, "dp.sync_enabled (inside dp.accumulate(n): true on the last piece only)"),
    "no_sync": (ACCELERATE, "with dp.no_sync(): ..."),
    "no_backward_sync": (FABRIC, "with dp.no_sync(enabled=...): ... (each micro-batch's shard_loss takes the step's "
                                 "global batch size)"),
    "unwrap_model": (ACCELERATE, "dp.module"),
    "autocast": (_BOTH, "phalanx.prepare(model, world=world, precision='bf16-mixed')"),
    "save_state": (ACCELERATE, "phalanx.checkpoint(path, world=world, model=dp, optimizer=...)"),
    "load_state": (ACCELERATE, "phalanx.resume(path, world=world, model=dp, optimizer=...)"),
    "save": (_BOTH, "phalanx.checkpoint(path, world=world, model=dp, optimizer=...), written by rank 0 atomically"),
    "load": (FABRIC, "phalanx.resume(path, world=world, model=dp, optimizer=...)"),
    "log": (_BOTH, "phalanx.MetricsLogger(out_dir, world=world).log(row)"),
    "log_dict": (FABRIC, "phalanx.MetricsLogger(out_dir, world=world).log(row)"),
    "seed_everything": (FABRIC, "torch.manual_seed(seed) on every rank (prepare broadcasts rank 0's weights)"),
    "to_device": (FABRIC, "tensor.to(world.device)"),
    "launch": (FABRIC, "phalanx.launch(train, devices='cpu:2') runs a function on the workers (a script: phalanx "
                       "run --devices cpu:2 script.py); each calls phalanx.init()"),
    "end_training": (ACCELERATE, "dp.close()"),
    "main_process_first": (ACCELERATE, "with phalanx.main_first(world=world): ..."),
    "local_main_process_first": (ACCELERATE, "with phalanx.main_first(world=world, per_host=True): ..."),
    "rank_zero_first": (FABRIC, "with phalanx.main_first(world=world): ... (local=True: per_host=True)"),
    "split_between_processes": (ACCELERATE, "phalanx.rank_shard(items, world=world): this rank's contiguous slice "
                                            "of a list or a tensor's rows, which phalanx.gather puts back in order"),
    "use_distributed": (ACCELERATE, "world.distributed"),
    "distributed_type": (ACCELERATE, "world.backend: 'gloo' for CPU workers, 'nccl' for GPUs, 'none' alone"),
    "is_last_process": (ACCELERATE, "world.rank == world.world_size - 1"),
    "on_main_process": (ACCELERATE, "if world.is_main: ... (no decorator)"),
    "on_local_main_process": (ACCELERATE, "if world.local_rank == 0: ... (no decorator)"),
    "on_last_process": (ACCELERATE, "if world.rank == world.world_size - 1: ... (no decorator)"),
    "on_process": (ACCELERATE, "if world.rank == r: ... (no decorator)"),
    "on_local_process": (ACCELERATE, "if world.local_rank == r: ... (no decorator)"),
    "mixed_precision": (ACCELERATE, "phalanx.prepare(model, world=world, precision='bf16-mixed'); "
                                    "dp.choices.describe() says what runs"),
    "gradient_accumulation_steps": (ACCELERATE, "the n of dp.accumulate(n)"),
    "join_uneven_inputs": (ACCELERATE, _SAME_BATCH_COUNT),
    "even_batches": (ACCELERATE, "not needed: phalanx.ShardedLoader splits the last batch unevenly and exactly, "
                                 "nothing repeated"),
    "prepare_model": (ACCELERATE, "dp = phalanx.prepare(model, world=world)"),
    "prepare_optimizer": (ACCELERATE, _OPTIMIZER_AS_IS),
    "setup_optimizers": (FABRIC, _OPTIMIZER_AS_IS),
    "prepare_scheduler": (ACCELERATE, "the scheduler as it is (every rank steps the same optimizer); "
                                      "phalanx.checkpoint(..., extras={'scheduler': scheduler}) saves it"),
    "register_for_checkpointing": (ACCELERATE, "phalanx.checkpoint(..., extras={'scheduler': scheduler}) and "
                                               "phalanx.resume(..., extras={'scheduler': scheduler})"),
    "unscale_gradients": (ACCELERATE, "scaler.unscale_(optimizer) after dp.finish_gradient_sync(), with "
                                      "torch.amp.GradScaler as on one device"),
    "clip_grad_value_": (ACCELERATE, "phalanx.clip_grad_value_(dp, value), after dp.finish_gradient_sync()"),
    "pad_across_processes": (ACCELERATE, "phalanx.gather(tensor, world=world) takes different row counts unpadded"),
    "init_trackers": (ACCELERATE, TRACKER_WAY),
    "get_tracker": (ACCELERATE, TRACKER_WAY),
    "loggers": (FABRIC, TRACKER_WAY),
    "logger": (FABRIC, TRACKER_WAY),
    "save_model": (ACCELERATE, "torch.save(dp.state_dict(), path) on rank 0 (world.is_main): no module. prefix"),
    "get_state_dict": (ACCELERATE, "dp.state_dict() (a sharded replica's whole: dp.full_state_dict())"),
    "free_memory": (ACCELERATE, "dp.close(), then drop the references"),
    "skip_first_batches": (ACCELERATE, "itertools.islice(loader.epoch(e), position.step, None), position being "
                                       "phalanx.resume's"),
    "set_trigger": (ACCELERATE, _TRIGGER),
    "check_trigger": (ACCELERATE, _TRIGGER),
    "strategy": (FABRIC, "dp = phalanx.prepare(model, world=world) is data parallel; prepare(..., shard='optimizer' | "
                         "'gradients' | 'parameters') for ZeRO's stages"),
    "call": (FABRIC, CALLBACKS_WAY),
    "callbacks": (FABRIC, CALLBACKS_WAY),
    "accelerator": (FABRIC, "world.device, and world.backend: 'gloo' for CPU workers, 'nccl' for GPUs"),
    "init_tensor": (FABRIC, "with torch.device(world.device): ... (prepare(model, world=world, dtype=...) casts "
                            "the model)"),
    "load_raw": (FABRIC, "model.load_state_dict(torch.load(path)) before phalanx.prepare, which broadcasts rank 0's "
                         "weights (dp.state_dict() has no module. prefix)"),
    "init_module": (FABRIC, "build the model as on one device: phalanx.prepare(model, world=world) moves it to "
                            "world.device and broadcasts rank 0's weights"),
}


def foreign_name_error(name: str) -> AttributeError:
    """The AttributeError for `name` asked of a World: phalanx's way where it is another tool's name."""
    if name not in FOREIGN_NAMES:
        return AttributeError(f"'World' object has no attribute {name!r}")
    whose, way = FOREIGN_NAMES[name]
    return AttributeError(f"'World' object has no attribute {name!r} ({whose} name): in phalanx, {way}")


# DistributedDataParallel's keywords -> what phalanx does instead (prepare's TypeError names it).
DDP_KEYWORDS: dict[str, str] = {
    "find_unused_parameters": _UNUSED_FOUND,
    "static_graph": "not needed: unused parameters are found every step, a parameter that reentrant activation "
                    "checkpointing lands more than once per backward is counted in the first step, and a change of "
                    "requires_grad lays the buckets out again",
    "broadcast_buffers": "plain BatchNorm statistics are averaged across ranks after each step and other buffers "
                         "are broadcast once here; DataParallelConfig(average_running_stats=False) turns the "
                         "averaging off",
    "gradient_as_bucket_view": "always: the gradients live in the buckets",
    "device_ids": "the device is world.device, chosen by phalanx.init()",
    "output_device": "the device is world.device, chosen by phalanx.init()",
    "process_group": _WORLD_GROUP,
    "init_sync": "prepare always broadcasts rank 0's parameters and buffers",
    "mixed_precision": "precision='bf16-mixed'",
    "dim": "the batch is cut along dim 0, by phalanx.ShardedLoader or phalanx.split_batch, before the forward",
    "check_reduction": _UNUSED_FOUND,
    "skip_all_reduce_unused_params": "not needed: what no rank used is found in the last bucket's own allreduce, "
                                     "and its gradient stays None, as on one device",
    "bucket_cap_mb_list": "bucket_cap_mb= sets one cap (the first bucket is smaller, DDP's min(cap, 1 MiB))",
    "delay_all_reduce_named_params": _BACKWARD_ORDER,
    "param_to_hook_all_reduce": _BACKWARD_ORDER,
    "device_mesh": _WORLD_GROUP,
    "batched_grad_copy": "always: the gradients live in the buckets, so nothing is copied into them",
    "forward_sync_buffers": "plain BatchNorm statistics are averaged across ranks after each step and other buffers "
                            "are broadcast once here",
    "lazy_bucket_allocation": "the gradients live in the buckets, allocated once; ZeRO's shard='gradients' keeps "
                              "1/k of them on each rank",  # torch 2.15
}


# Every keyword another tool hands where phalanx's prepare stands: name -> (whose, way).
PREPARE_KEYWORDS: dict[str, tuple[str, str]] = {
    **{name: ("DistributedDataParallel's", way) for name, way in DDP_KEYWORDS.items()},
    **HOROVOD_DEEPSPEED_KEYWORDS,
}


def foreign_keywords_error(names: list[str], *, call: str = "prepare") -> TypeError:
    """The TypeError for keywords `call` does not take: DDP's, DeepSpeed initialize's and Horovod
    DistributedOptimizer's named with phalanx's way, in one line."""
    name = next((name for name in names if name in PREPARE_KEYWORDS), None)
    if name is None:
        return TypeError(f"{call}() got an unexpected keyword argument {names[0]!r}")
    whose, way = PREPARE_KEYWORDS[name]
    return TypeError(f"{call}() takes no {name}= ({whose} keyword): {way}")


# DistributedDataParallel's methods -> what phalanx does instead (asked of a replica, an AttributeError names it).
DDP_METHODS: dict[str, str] = {
    "register_comm_hook": "the exchange takes no hook: prepare(model, world=world, grad_dtype='bf16') sends the "
                          "gradients compressed, as DDP's bf16_compress_hook / fp16_compress_hook do, and algorithm= "
                          "picks the allreduce",
    "join": f"{_SAME_BATCH_COUNT}; ranks that run different numbers of steps fail at once, naming both call sites",
    "join_hook": _SAME_BATCH_COUNT,
    "_set_static_graph": DDP_KEYWORDS["static_graph"],
}


# What a replica is asked where the script held DDP's wrapper or DeepSpeed's engine: name -> (whose, way).
REPLICA_NAMES: dict[str, tuple[str, str]] = {
    **{name: ("DistributedDataParallel's method", way) for name, way in DDP_METHODS.items()},
    **{name: ("DeepSpeed engine's name", way) for name, way in ENGINE_METHODS.items()},
    # Fabric's and Accelerate's object's, which a port calls on the model it set up (`backward`
    # is DeepSpeed's engine's above, with the same way).
    **{name: (f"{FOREIGN_NAMES[name][0]} name", FOREIGN_NAMES[name][1])
       for name in ("no_backward_sync", "clip_gradients", "clip_grad_norm_", "unwrap_model")},
}


def replica_name_error(owner: str, name: str) -> AttributeError:
    """The AttributeError for `name` asked of `owner` (a replica): phalanx's way where it is DDP's
    method or DeepSpeed's engine's."""
    if name not in REPLICA_NAMES:
        return AttributeError(f"'{owner}' object has no attribute {name!r}")
    whose, way = REPLICA_NAMES[name]
    return AttributeError(f"'{owner}' object has no attribute {name!r} ({whose}): in phalanx, {way}")
