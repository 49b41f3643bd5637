"""`phalanx bench splits`: the chapter's three ways to split LeNet over k devices, measured side by side.

For each k, one set of k spawned workers steps data, layers and channels on the same global
batch in interleaved rounds (a warm-up round first), so machine noise falls on all three. Per
step and device it records the bytes the counting transport sent, the step time (steps start
at a barrier; a step's time is the slowest device's), the share of the step spent blocked in
communication (the idle share: for a pipeline, its bubble plus transfers), the parameters held
and the peak activation memory (activation_memory.py).

`data` here is data parallelism with phalanx's ring allreduce (`--allreduce ring --no-overlap`)
through the counting transport, since gloo's native allreduce cannot be counted. Each split's
bytes per device also come from its formula (`expected_bytes`), written from the algorithm
rather than the code; the report prints both, and the tests require them equal.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from phalanx.bench.activation_memory import SavedTensorMeter
from phalanx.comm.counting import CountingTransport
from phalanx.comm.ring import allreduce_ring, chunk_sizes
from phalanx.data import shard_bounds
from phalanx.runtime.devices import parse_devices
from phalanx.runtime.launch import LaunchSpec, launch
from phalanx.models import LeNet
from phalanx.model_split.lenet_parts import UNITS, channel_counts, stage_plan, unit_shapes
from phalanx.model_split.splits import SCHEDULES, SPLITS, build_split, check_split
from phalanx.runtime.world import World

DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True, kw_only=True)
class SplitsBenchConfig:
    world_sizes: tuple[int, ...] = (2, 4)
    global_batch_size: int = 256
    micro_batches: int | None = None  # layers; None: 2k
    schedule: str = "gpipe"
    steps: int = 5  # timed steps per split per round
    rounds: int = 3
    dtype: str = "float32"
    timeout_s: float = 60.0
    deadline_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.world_sizes or any(k < 2 for k in self.world_sizes):
            raise ValueError(f"--devices {self.world_sizes} must list device counts of at least 2, e.g. 2,4")
        for k in self.world_sizes:
            for split in SPLITS:
                check_split(split, model="lenet", num_devices=k, global_batch_size=self.global_batch_size,
                            micro_batches=self.micro_batches if split == "layers" else None)
        if self.global_batch_size < max(self.world_sizes):
            raise ValueError(f"--batch-size {self.global_batch_size} is smaller than {max(self.world_sizes)} devices")
        if self.steps < 1 or self.rounds < 1:
            raise ValueError(f"--steps {self.steps} and --rounds {self.rounds} must be at least 1")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is unknown; choose one of {', '.join(DTYPES)}")
        if self.schedule not in SCHEDULES:  # checked here, not in a worker: one line, no traceback
            raise ValueError(f"--schedule {self.schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}")

    def micro_batches_for(self, k: int) -> int:
        return self.micro_batches if self.micro_batches is not None else min(2 * k, self.global_batch_size)


def expected_bytes(split: str, *, k: int, rank: int, batch: int, element_size: int) -> int:
    """Bytes device `rank` sends per step, from each algorithm's description (not from the code)."""
    shapes = unit_shapes(10)
    per_channel = {name: shape[1] * shape[2] if len(shape) == 3 else 1 for name, shape in shapes.items()}
    if split == "data":  # ring: reduce-scatter sends every chunk but (r+1)'s, all-gather every one but (r+2)'s
        chunks = chunk_sizes(sum(p.numel() for p in LeNet().parameters()), k)
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


class _DataParallelStep:
    """One data-parallel step with a flat ring allreduce through a counting transport."""

    def __init__(self, model: LeNet, *, world: World) -> None:
        self.module, self.world, self.transport = model, world, CountingTransport()

    def zero_grad(self) -> None:
        for p in self.module.parameters():
            p.grad = None

    def forward_backward(self, X, y, *, global_batch_size):
        start, stop = shard_bounds(X.shape[0], self.world.world_size, self.world.rank)
        (F.cross_entropy(self.module(X[start:stop]), y[start:stop], reduction="sum") / global_batch_size).backward()
        params = list(self.module.parameters())
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        allreduce_ring(flat, world=self.world, transport=self.transport)
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p))


def _worker(world: World, config: SplitsBenchConfig) -> dict:
    dtype, k = DTYPES[config.dtype], world.world_size
    g = torch.Generator().manual_seed(0)
    X = torch.randn(config.global_batch_size, 1, 28, 28, generator=g).to(dtype)
    y = torch.randint(0, 10, (config.global_batch_size,), generator=g)
    steppers = {}
    for split in SPLITS:
        torch.manual_seed(0)
        full = LeNet().to(dtype)
        steppers[split] = _DataParallelStep(full, world=world) if split == "data" else build_split(
            split, full, world=world, global_batch_size=config.global_batch_size,
            micro_batches=config.micro_batches_for(k), schedule=config.schedule)
    optimizers = {s: torch.optim.SGD(p.module.parameters(), lr=0.01) for s, p in steppers.items()}
    records = {s: [] for s in SPLITS}
    for round_index in range(config.rounds + 1):  # round 0 warms up and is discarded
        for split, stepper in steppers.items():
            for _ in range(config.steps):
                dist.barrier()
                before = stepper.transport.snapshot()
                meter = SavedTensorMeter(stepper.module.parameters())
                start = time.perf_counter()
                stepper.zero_grad()
                with meter:
                    stepper.forward_backward(X, y, global_batch_size=config.global_batch_size)
                optimizers[split].step()
                step_s = time.perf_counter() - start
                counts = stepper.transport.snapshot().minus(before)
                if round_index:
                    records[split].append({"step_s": step_s, "sent_bytes": counts.sent_bytes,
                                           "blocked_s": counts.blocked_s, "activation_bytes": meter.peak_bytes})
    params = {s: sum(p.numel() for p in st.module.parameters()) for s, st in steppers.items()}
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
            steps = range(len(per_rank[0]))
            step_s = [max(per_rank[r][i]["step_s"] for r in range(k)) for i in steps]
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
