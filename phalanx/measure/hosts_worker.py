"""The worker that runs on simulated hosts (`hosts_run.py`): gloo's flat allreduce against the
hierarchical one, alone and inside phalanx's training step, with the bytes each host's link carried.

Started by torchrun on every host of a bed (`python -m phalanx.measure.hosts_worker JOB OUT`),
it joins the job's world as any torchrun worker does (phalanx.runtime.launch) and runs, in each
of `rounds` interleaved rounds, every contender once:

- `allreduce flat`, `allreduce hierarchical/slices`, `allreduce hierarchical/leader`: the
  model's whole gradient as one float32 buffer, `allreduce_calls` times: gloo's own allreduce
  over all ranks, and the hierarchical one with each variant (comm/hierarchical.py);
- `step flat`, `step hierarchical`: `steps` of phalanx's training step (`prepare` +
  `train_batch`, overlapped buckets) with the allreduce `native` and `hierarchical`, on one
  fixed random global batch (as `bench scaling`'s worker), after `warmup_steps`.

Each is timed between two barriers on every rank (the slowest rank's time is the step's, as
lockstep makes it), and local rank 0 of each host reads its host's sent bytes before and after
(/sys/class/net/*/statistics/tx_bytes, every interface but lo): per call or step, what the host
put on its link. Rank 0 writes every rank's records as JSON to OUT.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from phalanx.comm import Hierarchy, allreduce, allreduce_hierarchical
from phalanx.data import split_batch
from phalanx.data_parallel import prepare
from phalanx.measure.mlp import build_bench_model
from phalanx.runtime.devices import parse_devices
from phalanx.runtime.launch import LaunchSpec, launch
from phalanx.runtime.world import World
from phalanx.train.loop import train_batch

ALLREDUCE_CONTENDERS = ("allreduce flat", "allreduce hierarchical/slices", "allreduce hierarchical/leader")
STEP_CONTENDERS = ("step flat", "step hierarchical")
CONTENDERS = ALLREDUCE_CONTENDERS + STEP_CONTENDERS
NET_DIR = Path("/sys/class/net")


@dataclass(frozen=True, kw_only=True)
class BedJob:
    """What every worker of the bed runs (JSON on disk: the agents pass it by path)."""

    model: str
    global_batch_size: int
    contenders: tuple[str, ...] = CONTENDERS
    rounds: int = 3
    allreduce_calls: int = 3
    warmup_steps: int = 2
    steps: int = 4
    lr: float = 0.01
    seed: int = 0
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        unknown = [c for c in self.contenders if c not in CONTENDERS]
        if unknown:
            raise ValueError(f"unknown contenders {unknown}; choose from {', '.join(CONTENDERS)}")
        for name in ("rounds", "allreduce_calls", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    @classmethod
    def from_json(cls, text: str) -> "BedJob":
        fields = json.loads(text)
        return cls(**{**fields, "contenders": tuple(fields["contenders"])})


def host_sent_bytes() -> int:
    """Bytes this host has sent on its interfaces (all but loopback), from their counters."""
    return sum(int((path / "statistics" / "tx_bytes").read_text()) for path in NET_DIR.iterdir()
               if path.name != "lo" and (path / "statistics" / "tx_bytes").exists())


def _shard(job: BedJob, world: World) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(job.seed)  # every rank draws the same global batch
    X = torch.randn(job.global_batch_size, 1, 28, 28, generator=generator)
    y = torch.randint(0, 10, (job.global_batch_size,), generator=generator)
    X_shard, y_shard = split_batch(X, y, world.world_size)[world.rank]
    return X_shard.contiguous(), y_shard.contiguous()


def _timed(world: World, fn: Callable[[], None], repeats: int) -> dict:
    """`fn` `repeats` times between barriers: seconds and this host's sent bytes, per repeat."""
    dist.barrier()
    sent0, start = host_sent_bytes(), time.perf_counter()
    for _ in range(repeats):
        fn()
    dist.barrier()
    elapsed, sent = time.perf_counter() - start, host_sent_bytes() - sent0
    return {"time_s": elapsed / repeats, "sent_bytes": sent / repeats}


def _worker(world: World, job: BedJob) -> list:
    X, y = _shard(job, world)
    torch.manual_seed(job.seed)
    replicas = {name: prepare(build_bench_model(job.model), world=world, batchnorm="local", algorithm=algorithm)
                for name, algorithm in (("step flat", "native"), ("step hierarchical", "hierarchical"))}
    variants = {f"allreduce hierarchical/{v}": Hierarchy(world=world, variant=v) for v in ("slices", "leader")}
    try:
        optimizers = {name: dp.optimizer(torch.optim.SGD, lr=job.lr) for name, dp in replicas.items()}
        gradient_numel = sum(p.numel() for p in replicas["step flat"].module.parameters())
        buffer = torch.randn(gradient_numel, generator=torch.Generator().manual_seed(world.rank))

        def run(name: str) -> None:
            if name == "allreduce flat":
                allreduce(buffer, world=world, algorithm="native")
            elif name in variants:
                allreduce_hierarchical(buffer, world=world, transport=variants[name])
            else:
                train_batch(replicas[name], optimizers[name], X, y, global_batch_size=job.global_batch_size)

        for name in job.contenders:  # warm-up: first calls open connections and fill caches
            for _ in range(job.warmup_steps if name in STEP_CONTENDERS else 1):
                run(name)
        records = []
        for round_index in range(job.rounds):
            for name in job.contenders:
                repeats = job.steps if name in STEP_CONTENDERS else job.allreduce_calls
                records.append({"round": round_index, "contender": name, "rank": world.rank,
                                "node_rank": world.node_rank, "local_rank": world.local_rank,
                                **_timed(world, lambda: run(name), repeats)})
        gathered: list = [None] * world.world_size
        dist.all_gather_object(gathered, records)
        first_line = replicas["step hierarchical"].choices.describe()
        return [{"records": [r for rank in gathered for r in rank], "gradient_bytes": gradient_numel * 4,
                 "first_line": first_line, "world_size": world.world_size,
                 "workers_per_host": world.local_world_size}] if world.rank == 0 else []
    finally:
        for hierarchy in variants.values():
            hierarchy.close()
        for dp in replicas.values():
            dp.close()


def main(argv: list[str]) -> int:
    """`python -m phalanx.measure.hosts_worker JOB.json OUT.json` under torchrun."""
    job_path, out_path = argv
    job = BedJob.from_json(Path(job_path).read_text())
    spec = LaunchSpec(plan=parse_devices("cpu:1", cuda_count=0), threads_per_device=1, timeout_s=job.timeout_s)
    result = launch(_worker, job, spec=spec)[0]
    if result:
        Path(out_path).write_text(json.dumps(result[0]))
    return 0


def job_json(job: BedJob) -> str:
    return json.dumps(asdict(job))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
