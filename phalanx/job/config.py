"""`phalanx train`'s configuration: the job's own options and its components', composed and validated.

`TrainConfig` holds what the job itself decides (the model, the epochs, the global batch, --out,
the checks and traces) and one config per component, each declared beside the code it
configures: `launch` (runtime/launch_config.py), `data` (data/config.py), `optim` (optim.py),
`data_parallel` (data_parallel/config.py), `split` (model_split/config.py), `checkpoint` and
`restarts` (checkpointing.py). Every field that is a flag says so once, with its help, default
and check (phalanx/options.py generates the parser; flags stay flat: `--no-overlap`). Each
component checks itself on construction; this class checks what spans components (--max-restarts
needs --checkpoint-every; --micro-batches fits the global batch). A `ValueError` names the flag
and the numbers; the CLI turns it into one line and exit 2. Picklable: workers receive it whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phalanx.data.config import DataConfig
from phalanx.data.split import accumulation_rows, shard_sizes
from phalanx.data_parallel.config import DataParallelConfig
from phalanx.data_parallel.guards.finite import DEFAULT_CHECK_FINITE_EVERY
from phalanx.job.checkpointing import CheckpointConfig, RestartConfig
from phalanx.job.optim import OptimizerConfig
from phalanx.model_split.config import SplitConfig
from phalanx.model_split.splits import check_split
from phalanx.models import INITS, MODELS, build_model, has_batchnorm
from phalanx.options import at_least, check_options, component, flags, option
from phalanx.runtime.launch_config import LaunchConfig
from phalanx.train.graph_plan import GRAPH_MODES, GraphPlan, StepFacts, plan

DTYPES = ("float32", "float64")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """the training job"""

    model: str = option("lenet", choices=MODELS, help="the model to train")
    init: str = option("pytorch", choices=INITS, help="weight initialisation (book: normal(0, 0.01))")
    # float64 makes k-device vs 1-device comparisons exact to ~1e-16: in float32 the rounding
    # differences of summing a batch in another order can grow chaotically while training
    # leaves its initial plateau (measured: 2e-6 to 5e-4 after 24 steps, depending on the seed).
    dtype: str = option("float32", choices=DTYPES, help="parameter dtype; float64 for exact equivalence checks")
    epochs: int = option(10, check=at_least(1), help="passes over the training set")
    global_batch_size: int = option(256, flag="--batch-size", check=at_least(1),
                                    help="global batch, split over the devices")
    # The epoch permutations are seeded from (seed, epoch), which must be >= 0.
    seed: int = option(0, check=at_least(0, problem="must be 0 or more; use e.g. --seed 0"),
                       help="seed of the initial model and the batch order")
    eval_batch_size: int = 1024
    out_dir: str | None = option(None, flag="--out", metavar="DIR", default_text="nothing written",
                                 help="write metrics.jsonl, accuracy.png, model.pt here")
    # An --out (or checkpoint dir) holding an earlier run's outputs is refused unless the run
    # continues it (resume) or replaces them (overwrite: they are deleted once the lock is held).
    overwrite: bool = option(False, help="replace an earlier run's outputs in --out / the checkpoint dir "
                                         "(default: refuse)")
    progress: bool = option(True, flag="--no-progress", help="no progress bar")
    # Every check_every steps: replicas compared bitwise, gradients checked finite (0: never); the
    # data split's replicas take it as their own check_finite_every (data_parallel/guards/finite.py).
    check_every: int = option(DEFAULT_CHECK_FINITE_EVERY, metavar="STEPS",
                              check=at_least(0, problem="must be 0 (off) or a number of steps"),
                              help="steps between replica-identity and finite-gradient checks; 0: off")
    # --trace DIR: Chrome traces per rank + rank 0's summary; the first trace_steps of each epoch.
    trace_dir: str | None = option(None, flag="--trace", metavar="DIR", default_text="no trace",
                                   help="write a Chrome trace per rank and a communication summary into DIR")
    trace_steps: int = option(20, check=at_least(1), help="steps traced per epoch with --trace")
    # auto: each full batch's step replayed as one CUDA graph where the run allows it; the first
    # log line names what ran, or what stood in the way (train/graph_plan.py).
    cuda_graphs: str = option("auto", choices=GRAPH_MODES, help="run each full batch's step as one CUDA graph "
                              "(auto: on one CUDA device where the run allows; on: insist; off: eager)")
    launch: LaunchConfig = component(LaunchConfig)
    data: DataConfig = component(DataConfig)
    optim: OptimizerConfig = component(OptimizerConfig)
    data_parallel: DataParallelConfig = component(DataParallelConfig)
    split: SplitConfig = component(SplitConfig)
    checkpoint: CheckpointConfig = component(CheckpointConfig)
    restarts: RestartConfig = component(RestartConfig)

    def __post_init__(self) -> None:
        check_options(self)
        if self.eval_batch_size < 1:
            raise ValueError(f"eval batch size {self.eval_batch_size} must be at least 1")
        if self.checkpoint.every is not None and self.checkpoint_location is None:
            raise ValueError("--checkpoint-every needs somewhere to write; add --checkpoint-dir DIR or --out DIR")
        if self.overwrite and self.checkpoint.resume is not None:
            raise ValueError(f"--overwrite starts afresh and --resume {self.checkpoint.resume} continues; "
                             "pass one of them")
        if self.restarts.max_restarts and self.checkpoint.every is None:
            raise ValueError(f"--max-restarts {self.restarts.max_restarts} restarts from the last checkpoint; "
                             "add --checkpoint-every N (or epoch)")
        if self.optim.warmup_epochs >= self.epochs:  # as sweep's: the warmup ends before the run does
            raise ValueError(f"--warmup-epochs {self.optim.warmup_epochs:g} must be below --epochs {self.epochs}, so "
                             f"the lr reaches --lr {self.optim.lr:g} before the run ends; use e.g. --warmup-epochs "
                             f"{self.epochs / 2:g}")
        if self.checkpoint.resume == "auto" and self.checkpoint_location is None:
            raise ValueError("--resume auto looks in the checkpoint dir; add --checkpoint-dir DIR or --out DIR")
        self._check_split()

    def _check_split(self) -> None:
        micro_batches = self.split.micro_batches
        if micro_batches is not None and not 1 <= micro_batches <= self.global_batch_size:
            raise ValueError(f"--micro-batches {micro_batches} must be between 1 and the global batch "
                             f"({self.global_batch_size}); use e.g. --micro-batches 4")
        if self.split.kind == "data":
            return
        # Every replica option (the exchange, buckets, overlap, memory format, BatchNorm policy,
        # sharding): a split has no replicas, and would ignore it without a word.
        for flag in flags(DataParallelConfig):
            value = getattr(self.data_parallel, flag.path[-1])
            if value != flag.default:
                name = "--no-" + flag.name[2:] if value is False else flag.name
                raise ValueError(f"{name} is a data-parallel option; drop it with --split {self.split.kind}")
        if self.trace_dir is not None:
            raise ValueError(f"--trace traces the data-parallel exchange; drop it with --split {self.split.kind}")
        # A split's checkpoint holds the whole model's optimizer without the shards' state, and the
        # global norm would need the parts' norms added up: the splits train with plain SGD.
        for flag, value, default in (("--optimizer", self.optim.optimizer, "sgd"), ("--momentum", self.optim.momentum, 0.0),
                                     ("--clip-grad-norm", self.optim.clip_grad_norm, None)):
            if value != default:
                raise ValueError(f"--split {self.split.kind} trains with plain SGD (no momentum, no clipping); "
                                 f"drop {flag}")

    def graph_plan(self, device_type: str, num_devices: int, *, backend: str = "nccl") -> GraphPlan:
        """Whether this run's step is captured on `num_devices` devices of `device_type`;
        ValueError naming the refusal when --cuda-graphs on cannot be honoured."""
        options = self.data_parallel
        sync_bn = num_devices > 1 and self.split.kind == "data" and options.batchnorm == "sync"
        if sync_bn:
            with torch.device("meta"):  # the layers' kinds, with no memory or initialisation (mlp: 32 -> 0.7 ms)
                sync_bn = has_batchnorm(build_model(self.model))
        return plan(self.cuda_graphs, StepFacts(
            device_type=device_type, num_devices=num_devices, split=self.split.kind,
            grad_accum_steps=options.grad_accum_steps, tracing=self.trace_dir is not None, sync_batchnorm=sync_bn,
            allreduce=options.allreduce, backend=backend, lr_changes_every_step=self.optim.warmup_epochs > 0))

    @property
    def checkpoint_location(self) -> str | None:
        if self.checkpoint.directory is not None:
            return self.checkpoint.directory
        return None if self.out_dir is None else f"{self.out_dir}/checkpoints"

    def check_devices(self, num_devices: int) -> None:
        """Every device needs at least one example of each global batch."""
        if self.global_batch_size < num_devices:
            raise ValueError(
                f"--batch-size {self.global_batch_size} is smaller than the {num_devices} devices; "
                f"use --batch-size {num_devices} or more, or fewer devices"
            )
        check_split(self.split.kind, model=self.model, num_devices=num_devices, micro_batches=self.split.micro_batches,
                    global_batch_size=self.global_batch_size)

    def check_batch_statistics(self, num_train: int, num_devices: int, *, batchnorm: bool) -> None:
        """A BatchNorm model (`batchnorm`: the model holds BatchNorm layers) normalizes every micro-batch
        by its own statistics, which torch refuses for fewer than 2 examples: a run whose smallest one
        (often the epoch's last, smaller batch) would hold fewer is refused before it trains, not at that batch."""
        if self.split.kind != "data" or not batchnorm:
            return
        accum = self.data_parallel.grad_accum_steps
        per_rank = self.data_parallel.batchnorm == "local" and num_devices > 1  # else over the global micro-batch
        full, last = divmod(num_train, self.global_batch_size)
        for size in [self.global_batch_size] * (full > 0) + [last] * (last > 0):
            smallest = min(min(accumulation_rows(size, num_devices, rank, accum)[1]) for rank in range(num_devices)) \
                if per_rank else min(shard_sizes(size, accum))
            if smallest >= 2:
                continue
            unit = ("device's share of a " if per_rank else "") + ("micro-batch" if accum > 1 else "batch")
            which = (f"the epoch's last batch ({num_train} = {full} x {self.global_batch_size} + {last})"
                     if size == last else f"a batch of {size}")
            cut = (f" on {num_devices} devices (--batchnorm local)" if per_rank else "") + \
                  (f" in --grad-accum {accum} micro-batches" if accum > 1 else "")
            fix = (f"use --train-examples {full * self.global_batch_size} (whole batches)" if size == last and full
                   else f"use --batch-size {2 * accum * (num_devices if per_rank else 1)} or more")
            fix += ", or a smaller --grad-accum" if accum > 1 else ""
            examples = "example" if smallest == 1 else "examples"
            raise ValueError(f"--model {self.model} normalizes each {unit} by its own statistics, which takes 2 or "
                             f"more examples, and {which}{cut} leaves one of {smallest} {examples}: {fix}")
