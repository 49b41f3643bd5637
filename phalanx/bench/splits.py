"""`phalanx bench splits`: the chapter's three ways to split LeNet over k devices, measured side by side.

For each k, one set of k spawned workers steps data, layers and channels on the same global
batch in interleaved rounds (a warm-up round first), so machine noise falls on all three. Per
step and device it records the bytes the counting transport sent, the step time (steps start
at a barrier; a step's time is the slowest device's), the share of the step spent blocked in
communication (the idle share: for a pipeline, its bubble plus transfers), the parameters held
and the peak activation memory (activation_memory.py).

Every split steps through `train_step`, the one step `phalanx train` runs (train/loop.py), each
as its `Strategy`: `data` is a DataParallel with phalanx's ring allreduce (`--allreduce ring
--no-overlap`, one flat bucket) exchanging over a counting transport (`DataParallel.over`), since
gloo's native allreduce cannot be counted. Each split's bytes per device also come from its
formula (`expected_bytes`), written from the algorithm rather than the code; the report prints
both, and the tests require them equal.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from phalanx.bench.activation_memory import SavedTensorMeter
from phalanx.comm import ALLREDUCE, Handle, Tag
from phalanx.comm.counting import CountingTransport
from phalanx.comm.ring import allreduce_ring, chunk_sizes
from phalanx.data_parallel import DataParallel, DataParallelConfig
from phalanx.data_parallel.strategy import DataSplit
from phalanx.measure.timing import slowest_per_round
from phalanx.model_split.lenet_parts import UNITS, channel_counts, stage_plan, unit_shapes
from phalanx.model_split.splits import SCHEDULES, SPLITS, build_split, check_split
from phalanx.models import LeNet
from phalanx.options import at_least, device_count, check_options, option
from phalanx.runtime.devices import parse_devices
from phalanx.runtime.launch import LaunchSpec, launch
from phalanx.runtime.world import World
from phalanx.train.loop import train_step

DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True, kw_only=True)
class SplitsBenchConfig:
    """data vs layers vs channels on LeNet: bytes, time, idle, memory"""

    world_sizes: tuple[int, ...] = option((2, 4), flag="--devices", items=device_count, check=at_least(2),
                                          help="device counts k, one spawned run each")
    global_batch_size: int = option(256, flag="--batch-size", help="global batch")
    micro_batches: int | None = option(None, default_text="2k", help="layers: micro-batches")
    schedule: str = option("gpipe", choices=SCHEDULES, help="layers: the pipeline's schedule")
    steps: int = option(5, check=at_least(1), help="timed steps per split per round")
    rounds: int = option(3, check=at_least(1), help="interleaved rounds")
    dtype: str = option("float32", choices=tuple(DTYPES), help="parameter dtype")
    timeout_s: float = 60.0
    deadline_s: float = 600.0

    def __post_init__(self) -> None:
        check_options(self)
        for k in self.world_sizes:
            for split in SPLITS:
                check_split(split, model="lenet", num_devices=k, global_batch_size=self.global_batch_size,
                            micro_batches=self.micro_batches if split == "layers" else None)
        if self.global_batch_size < max(self.world_sizes):
            raise ValueError(f"--batch-size {self.global_batch_size} is smaller than {max(self.world_sizes)} devices")

    def micro_batches_for(self, k: int) -> int:
        return self.micro_batches if self.micro_batches is not None else min(2 * k, self.global_batch_size)


def expected_bytes(split: str, *, k: int, rank: int, batch: int, element_size: int) -> int:
    """Bytes device `rank` sends per step, from each algorithm's description (not from the code)."""
    shapes = unit_shapes(10)
    per_channel = {name: shape[1] * shape[2] if len(shape) == 3 else 1 for name, shape in shapes.items()}
    if split == "data":  # ring: reduce-scatter sends every chunk but (r+1)'s, all-gather every one but (r+2)'s
        params = list(LeNet().parameters())  # every gradient, and a usage flag per tensor (data_parallel/usage.py)
        chunks = chunk_sizes(sum(p.numel() for p in params) + len(params), k)
        return element_size * (2 * sum(chunks) - chunks[(rank + 1) % k] - chunks[(rank + 2) % k])
    if split == "layers":  # the stage's output forward, its input's gradient back (micro-batches sum to the batch)
        plan = stage_plan(k)
        out = batch * math.prod(shapes[plan[rank][-1]]) if rank < k - 1 else 0
        back = batch * math.prod(shapes[plan[rank - 1][-1]]) if rank > 0 else 0
        return element_size * (out + back)
    total = 0  # channels: gather = own shard to k-1 peers; reduce-scatter = the others' slices
    for name in UNITS:
        counts = channel_counts(shapes[name][0], k)
        total += (k - 1) * counts[rank] * per_channel[name] * batch
        if name != UNITS[-1]:
            total += (sum(counts) - counts[rank]) * per_channel[name] * batch
    return element_size * total


class _CountingRing:
    """What DataParallel exchanges through here (its `comm`): the ring allreduce over a counting
    transport, so the data split's bytes are counted on the wire as the model splits' are."""

    def __init__(self, world: World) -> None:
        self.world, self.transport = world, CountingTransport()

    def allreduce(self, tensor: torch.Tensor, *, algorithm: str, tag: Tag = ALLREDUCE) -> torch.Tensor:
        """The gradient buckets, counted; the replica's own small sums beside them (its checks: the
        shard_loss sizes at synced steps 1, 2, 4, ..., the NaN/Inf notes every 100) over the same
        ring, not counted, since the formula is the gradient exchange's and they come at some steps only."""
        counted = tag.phase == "gradient"
        allreduce_ring(tensor, world=self.world, transport=self.transport if counted else self.transport.inner)
        return tensor

    def allreduce_async(self, tensor: torch.Tensor, *, algorithm: str, tag: Tag = ALLREDUCE,
                        on_done=None) -> Handle:
        """DataParallel's one send path: the ring runs now, on this thread, so the handle is done."""
        self.allreduce(tensor, algorithm=algorithm, tag=tag)
        if on_done is not None:
            on_done()
        return Handle(tensor, None, lambda: None)


def _strategy(split: str, config: SplitsBenchConfig, world: World):
    """This rank's `Strategy` for `split` (the same initial LeNet on every rank) and its counting transport."""
    torch.manual_seed(0)
    full = LeNet().to(DTYPES[config.dtype])
    if split == "data":
        comm = _CountingRing(world)
        # One flat bucket, synchronous: prepare's --allreduce ring --no-overlap (LeNet is contiguous as made).
        dp = DataParallel.over(comm, full, world=world,
                               options=DataParallelConfig(allreduce="ring", overlap=False, bucket_cap_mb=None))
        return DataSplit(dp), comm.transport
    strategy = build_split(split, full, world=world, global_batch_size=config.global_batch_size,
                           micro_batches=config.micro_batches_for(world.world_size), schedule=config.schedule)
    return strategy, strategy.transport


def _worker(world: World, config: SplitsBenchConfig) -> dict:
    g = torch.Generator().manual_seed(0)
    X = torch.randn(config.global_batch_size, 1, 28, 28, generator=g).to(DTYPES[config.dtype])
    y = torch.randint(0, 10, (config.global_batch_size,), generator=g)
    strategies = {split: _strategy(split, config, world) for split in SPLITS}
    optimizers = {s: torch.optim.SGD(st.module.parameters(), lr=0.01) for s, (st, _) in strategies.items()}
    records = {s: [] for s in SPLITS}
    for round_index in range(config.rounds + 1):  # round 0 warms up and is discarded
        for split, (strategy, transport) in strategies.items():
            rows = strategy.rows(config.global_batch_size)
            for _ in range(config.steps):
                dist.barrier()
                before = transport.snapshot()
                meter = SavedTensorMeter(strategy.module.parameters())
                start = time.perf_counter()
                with meter:  # zero_grad and the optimizer step save nothing for backward
                    train_step(strategy, optimizers[split], X[rows], y[rows],
                               global_batch_size=config.global_batch_size)
                step_s = time.perf_counter() - start
                counts = transport.snapshot().minus(before)
                if round_index:
                    records[split].append({"step_s": step_s, "sent_bytes": counts.sent_bytes,
                                           "blocked_s": counts.blocked_s, "activation_bytes": meter.peak_bytes})
    params = {s: sum(p.numel() for p in st.module.parameters()) for s, (st, _) in strategies.items()}
    for strategy, _ in strategies.values():
        strategy.close()
    return {"records": records, "parameters": params}


def run_splits_bench(config: SplitsBenchConfig, *, on_run=None) -> dict:
    """Measure every split at every k; the payload JSON holds per-device numbers and the formulas."""
    rows = []
    element_size = torch.empty((), dtype=DTYPES[config.dtype]).element_size()
    for k in config.world_sizes:
        if on_run is not None:
            on_run(f"k = {k}: data, layers, channels interleaved, {config.rounds} rounds of {config.steps} steps")
        plan = parse_devices(f"cpu:{k}", cuda_count=0)
        results = launch(_worker, config, spec=LaunchSpec(plan=plan, threads_per_device=1, timeout_s=config.timeout_s,
                                                          deadline_s=config.deadline_s))
        for split in SPLITS:
            per_rank = [r["records"][split] for r in results]
            step_s = slowest_per_round([[s["step_s"] for s in records] for records in per_rank])
            micro = config.micro_batches_for(k)
            rows.append({
                "split": split, "k": k, "micro_batches": micro if split == "layers" else None,
                "sent_bytes_per_device": [per_rank[r][0]["sent_bytes"] for r in range(k)],
                "sent_bytes_consistent": all(len({s["sent_bytes"] for s in per_rank[r]}) == 1 for r in range(k)),
                "formula_bytes_per_device": [expected_bytes(split, k=k, rank=r, batch=config.global_batch_size,
                                                            element_size=element_size)
                                             for r in range(k)],
                "step_s_median": statistics.median(step_s), "step_s_min": min(step_s), "step_s_max": max(step_s),
                "idle_share_per_device": [statistics.median(s["blocked_s"] / s["step_s"] for s in per_rank[r])
                                          for r in range(k)],
                "bubble_gpipe": (k - 1) / (micro + k - 1) if split == "layers" else None,
                "parameters_per_device": [r["parameters"][split] for r in results],
                "activation_bytes_per_device": [max(s["activation_bytes"] for s in per_rank[r]) for r in range(k)],
            })
    return {"benchmark": "splits", "config": asdict(config), "element_size": element_size, "rows": rows}
