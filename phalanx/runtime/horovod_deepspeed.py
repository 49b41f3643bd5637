"""What Horovod and DeepSpeed call what phalanx calls otherwise: the names a script ported from
either asks of the `phalanx` module (Horovod's `hvd.rank()`, `hvd.DistributedOptimizer`,
DeepSpeed's `deepspeed.initialize`), of the replica (DeepSpeed's engine: `engine.backward(loss)`,
`engine.step()`, `engine.save_checkpoint`), and the keywords it hands `prepare` (DeepSpeed
initialize's `config=`, Horovod DistributedOptimizer's `compression=`). Each is an AttributeError
or a TypeError naming phalanx's way in one line (docs/horovod-deepspeed.md), where Python alone
says "has no attribute". foreign_names.py does the same for Accelerate, Fabric and DDP. Plain
tables: `import phalanx` reads them without loading torch.
"""

from __future__ import annotations

from types import FrameType

HOROVOD, DEEPSPEED = "Horovod's", "DeepSpeed's"

_WORLD = "world = phalanx.init(), then world.{}"
_PREPARE = ("dp = phalanx.prepare(model, world=world) sums the gradients; the optimizer as it is over dp.parameters(); "
            "dp.finish_gradient_sync() between loss.backward() and optimizer.step() (optimizer.step() before it is "
            "refused)")
_REDUCE = "phalanx.reduce(value, op='mean' | 'sum', world=world): in float64, on every rank"
_GATHER = "phalanx.gather(tensor, world=world): every rank's rows concatenated in rank order, unpadded"
_BUILT = "world.backend says what runs: 'gloo' for CPU workers (their gradients through shared memory), 'nccl' for GPUs"
_OTHER_COLLECTIVE = "torch.distributed's own on the world's group, which phalanx.init() opened"
_SAME_BATCH_COUNT = "not needed: phalanx.ShardedLoader gives every rank the same number of batches"
_RESTARTS = ("phalanx run --max-restarts N starts the workers again after a failure, and the script goes on from its "
             "last phalanx.checkpoint with phalanx.resume (docs/faults.md)")
_CHECKPOINT = "phalanx.checkpoint(path, world=world, model=dp, optimizer=..., extras={...}): written by rank 0 atomically"
_OPS = "phalanx.reduce(value, op='mean' | 'sum', world=world); the gradients are summed (phalanx.shard_loss)"

# Asked of the phalanx module: name -> (whose, phalanx's way).
MODULE_NAMES: dict[str, tuple[str, str]] = {
    "rank": (HOROVOD, _WORLD.format("rank")),
    "size": (HOROVOD, _WORLD.format("world_size")),
    "local_rank": (HOROVOD, _WORLD.format("local_rank")),
    "local_size": (HOROVOD, _WORLD.format("local_world_size")),
    "cross_rank": (HOROVOD, _WORLD.format("node_rank")),
    "cross_size": (HOROVOD, "world = phalanx.init(), then world.world_size // world.local_world_size (the hosts)"),
    "is_initialized": (HOROVOD, "world = phalanx.init() returns the world; world.distributed"),
    "shutdown": (HOROVOD, "dp.close() ends a replica's exchange; phalanx run closes the group when the script ends"),
    "DistributedOptimizer": (HOROVOD, _PREPARE),
    "broadcast_parameters": (HOROVOD, "not needed: phalanx.prepare broadcasts rank 0's parameters and buffers"),
    "broadcast_optimizer_state": (HOROVOD, "not needed: every rank builds the same optimizer, and phalanx.resume "
                                           "loads the same state on every rank"),
    "broadcast_object": (HOROVOD, "phalanx.broadcast(obj, src=0, world=world)"),
    "broadcast_": (HOROVOD, "phalanx.broadcast(obj, src=0, world=world) returns rank 0's, it writes nothing in place"),
    "allreduce_": (HOROVOD, _REDUCE),
    "allreduce_async": (HOROVOD, _REDUCE),
    "allreduce_async_": (HOROVOD, _REDUCE),
    "grouped_allreduce": (HOROVOD, f"{_REDUCE} (a tensor's elements in one collective)"),
    "allgather": (HOROVOD, _GATHER),
    "allgather_object": (HOROVOD, "phalanx.gather(torch.as_tensor(rows), world=world) for numbers; "
                                  "phalanx.broadcast(obj, src=r, world=world) for one rank's object"),
    "alltoall": (HOROVOD, _OTHER_COLLECTIVE),
    "reducescatter": (HOROVOD, _OTHER_COLLECTIVE),
    "join": (HOROVOD, _SAME_BATCH_COUNT),
    "Average": (HOROVOD, _OPS),
    "Sum": (HOROVOD, _OPS),
    "Adasum": (HOROVOD, "no Adasum: the gradients are summed, so k devices train as one device on the global batch"),
    "Compression": (HOROVOD, "phalanx.prepare(model, world=world, grad_dtype='fp16' | 'bf16') sends the gradients "
                             "compressed"),
    "SyncBatchNorm": (HOROVOD, "phalanx.prepare converts BatchNorm to phalanx's SyncBatchNorm itself (batchnorm='sync'); "
                               "phalanx.convert_sync_batchnorm for a model you convert yourself"),
    "elastic": (HOROVOD, _RESTARTS),
    "start_timeline": (HOROVOD, "phalanx train --trace DIR writes each rank's timeline of backward and bucket "
                                "exchanges (docs/tracing.md); a script's own, torch.profiler"),
    "nccl_built": (HOROVOD, _BUILT),
    "gloo_built": (HOROVOD, _BUILT),
    "mpi_built": (HOROVOD, _BUILT),
    "mpi_enabled": (HOROVOD, _BUILT),
    "gloo_enabled": (HOROVOD, _BUILT),
    "initialize": (DEEPSPEED, "dp = phalanx.prepare(model, world=world) (shard='optimizer' | 'gradients' | "
                              "'parameters' for ZeRO's stages); the optimizer over dp.parameters() (under shard=, "
                              "dp.optimizer(torch.optim.AdamW, lr=...)); phalanx.ShardedLoader for the data"),
    "init_distributed": (DEEPSPEED, "world = phalanx.init(): the backend for the device, its rank and world size"),
    "add_config_arguments": (DEEPSPEED, "phalanx reads no config file: what one sets is phalanx.prepare's keywords "
                                        "and the script's own lines (docs/horovod-deepspeed.md)"),
    "zero": (DEEPSPEED, "phalanx.prepare(model, world=world, shard='parameters') is ZeRO-3 (docs/sharding.md)"),
    "checkpointing": (DEEPSPEED, "torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False), as on one device"),
}

# DeepSpeed engine's methods and attributes, asked of the replica: name -> phalanx's way.
ENGINE_METHODS: dict[str, str] = {
    "backward": "phalanx.shard_loss(loss_sum, global_size).backward(), then dp.finish_gradient_sync()",
    "step": "optimizer.step() after dp.finish_gradient_sync() (and the scheduler's own step())",
    "save_checkpoint": f"{_CHECKPOINT} (client_state: extras=)",
    "load_checkpoint": "phalanx.resume(path, world=world, model=dp, optimizer=..., extras={...})",
    "save_16bit_model": "torch.save(dp.state_dict(), path) on rank 0 (a sharded replica's whole: dp.full_state_dict())",
    "local_rank": "dp.world.local_rank",
    "global_rank": "dp.world.rank",
    "world_size": "dp.world.world_size",
    "dp_world_size": "dp.world.world_size",
    "gradient_accumulation_steps": "the n of dp.accumulate(n)",
    "is_gradient_accumulation_boundary": "dp.sync_enabled (inside dp.accumulate(n): true on the last piece only)",
    "set_gradient_accumulation_boundary": "dp.require_backward_grad_sync = True (or False), the switch no_sync() turns",
    "train_batch_size": "the global_batch_size handed to phalanx.ShardedLoader",
    "train_micro_batch_size_per_gpu": "phalanx.shard_sizes(global_batch_size, world.world_size)[world.rank]",
    "zero_optimization_stage": "dp.choices.describe() says the shard (phalanx.prepare's shard=)",
    "bfloat16_enabled": "dp.choices.describe() says the precision (phalanx.prepare's precision=)",
    "fp16_enabled": "dp.choices.describe() says the precision (phalanx.prepare's precision=)",
    "get_lr": "[group['lr'] for group in optimizer.param_groups]",
    "get_global_grad_norm": "phalanx.clip_grad_norm_(dp, max_norm) returns the global norm before clipping",
    "gradient_clipping": "phalanx.clip_grad_norm_(dp, max_norm), after dp.finish_gradient_sync()",
    "global_steps": "the script's own step count (phalanx.resume returns a Position: its epoch and step)",
    "was_step_applied": "every step applies with precision='bf16-mixed'; torch.amp.GradScaler skips one on an overflow",
    "train_batch": "a step of the script's own loop: dp(x), phalanx.shard_loss(...).backward(), "
                   "dp.finish_gradient_sync(), optimizer.step()",
}

# ZeRO's stage numbers -> phalanx's shard= names (what each stage keeps 1/k of).
ZERO_STAGES = {0: "none", 1: "optimizer", 2: "gradients", 3: "parameters"}
ZERO_STAGE_NAMES = "stage 0 is 'none', 1 'optimizer', 2 'gradients', 3 'parameters'"
_DS_CONFIG = "DeepSpeed config's"

# Keywords handed to prepare: name -> (whose, phalanx's way).
KEYWORDS: dict[str, tuple[str, str]] = {
    # A ds_config.json's keys handed as keywords: each is one of prepare's, or a line of the script.
    "zero_optimization": (_DS_CONFIG, f"shard= names ZeRO's stage ({ZERO_STAGE_NAMES})"),
    "bf16": (_DS_CONFIG, "precision='bf16-mixed'"),
    "fp16": (_DS_CONFIG, "torch.autocast(..., dtype=torch.float16) and torch.amp.GradScaler in the script, as on "
                         "one device"),
    "gradient_clipping": (_DS_CONFIG, "phalanx.clip_grad_norm_(dp, max_norm), after dp.finish_gradient_sync()"),
    "gradient_accumulation_steps": (_DS_CONFIG, "for piece in dp.accumulate(n): ..."),
    "train_batch_size": (_DS_CONFIG, "phalanx.ShardedLoader(dataset, world=world, global_batch_size=...)"),
    "train_micro_batch_size_per_gpu": (_DS_CONFIG, "it follows from phalanx.ShardedLoader's global_batch_size= "
                                                   "(phalanx.shard_sizes(global_batch_size, world.world_size))"),
    "config": ("DeepSpeed initialize's", "phalanx reads no config: its keys are prepare's keywords (shard=, "
                                         "precision=, grad_dtype=) and the script's own lines "
                                         "(docs/horovod-deepspeed.md)"),
    "config_params": ("DeepSpeed initialize's", "phalanx reads no config: its keys are prepare's keywords (shard=, "
                                                "precision=, grad_dtype=) and the script's own lines"),
    "model_parameters": ("DeepSpeed initialize's", "build the optimizer over dp.parameters() after prepare"),
    "optimizer": ("DeepSpeed initialize's", "build the optimizer over dp.parameters() after prepare (under shard=: "
                                            "dp.optimizer(torch.optim.AdamW, lr=...))"),
    "training_data": ("DeepSpeed initialize's", "phalanx.ShardedLoader(dataset, world=world, global_batch_size=...)"),
    "collate_fn": ("DeepSpeed initialize's", "phalanx.ShardedLoader(dataset, world=world, global_batch_size=..., "
                                             "collate_fn=...)"),
    "lr_scheduler": ("DeepSpeed initialize's", "the scheduler as it is, stepped after optimizer.step(); "
                                               "phalanx.checkpoint(..., extras={'scheduler': scheduler}) saves it"),
    "args": ("DeepSpeed initialize's", "phalanx reads no command line: prepare's keywords are set in the script"),
    "mpu": ("DeepSpeed initialize's", "phalanx is data parallel over the whole world; no model-parallel unit"),
    "dist_init_required": ("DeepSpeed initialize's", "world = phalanx.init() opens or adopts the group, once"),
    "distributed_port": ("DeepSpeed initialize's", "phalanx run's store takes a free port itself (under torchrun: "
                                                   "its --master-port)"),
    "mesh_param": ("DeepSpeed initialize's", "phalanx is data parallel over the whole world; no device mesh"),
    "named_parameters": ("Horovod DistributedOptimizer's", "not needed: prepare finds the model's parameters"),
    "compression": ("Horovod DistributedOptimizer's", "grad_dtype='fp16' | 'bf16'"),
    "backward_passes_per_step": ("Horovod DistributedOptimizer's", "for piece in dp.accumulate(n): ..."),
    "op": ("Horovod DistributedOptimizer's", "the gradients are summed: backpropagate phalanx.shard_loss(loss_sum, "
                                             "global_size); average=True gives a mean of the ranks' means"),
    "gradient_predivide_factor": ("Horovod DistributedOptimizer's", "not needed: phalanx.shard_loss divides each "
                                                                    "shard's loss by the global batch size"),
    "sparse_as_dense": ("Horovod DistributedOptimizer's", "always: sparse gradients are summed dense in the buckets, "
                                                          "then handed back sparse"),
    "process_set": ("Horovod DistributedOptimizer's", "phalanx has one world; no process sets"),
}


def module_name_error(name: str, *, asker: FrameType | None = None,
                      also: dict[str, tuple[str, str]] | None = None) -> AttributeError | ImportError:
    """The AttributeError for `name` asked of the phalanx module: phalanx's way where it is Horovod's
    or DeepSpeed's. Asked by `from phalanx import DistributedOptimizer` (`asker`, the frame that
    asked, is at an IMPORT_FROM), the ImportError that statement raises, with the way in it:
    Python replaces an AttributeError there by its bare "cannot import name"."""
    # Horovod's and DeepSpeed's module names, then `also`'s (Accelerate's and Fabric's object's: a
    # ported `fabric.save(...)` becomes `phalanx.save(...)` as often as `world.save(...)`).
    found = MODULE_NAMES.get(name) or (also or {}).get(name)
    if found is None:
        return AttributeError(f"module 'phalanx' has no attribute {name!r}")
    whose, way = found
    if asker is not None and _importing_from(asker):
        return ImportError(f"cannot import name {name!r} from 'phalanx' ({whose} name): in phalanx, {way}",
                           name="phalanx")
    return AttributeError(f"module 'phalanx' has no attribute {name!r} ({whose} name): in phalanx, {way}")


def _importing_from(frame: FrameType) -> bool:
    """Whether `frame` is running a `from ... import name` statement's IMPORT_FROM (Python 3.10-3.13)."""
    import dis

    code = frame.f_code.co_code
    return 0 <= frame.f_lasti < len(code) and dis.opname[code[frame.f_lasti]] == "IMPORT_FROM"
