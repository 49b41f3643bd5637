"""`phalanx bench memory`: what each rank holds and how fast it steps, phalanx's ZeRO stages beside PyTorch's.

Contenders, each k fresh processes training a model with Adam on one fixed synthetic
batch: torch DDP; DDP with `ZeroRedundancyOptimizer` (ZeRO-1: each rank the Adam state of
whole parameters it is assigned); FSDP2 (`fully_shard` per layer, then the root: ZeRO-3); and
phalanx with `shard="none" | "optimizer" | "gradients" | "parameters"`. How each runs, is timed
and reports its memory is the measuring kit's (measure/step.py, measure/memory.py): per rank,
the bytes of parameters, gradients and optimizer state it holds after its steps (counted from
its tensors, not from a formula), its resident set before the model was built, its peak over
the set-up, after the first 5 steps and over all of them (VmHWM), and its step time. 20 timed
steps after 2 untimed ones: a peak that grows with the steps (a tensor kept per step pinned
glibc's heap: 0.7 -> 1.4-2.1 GB in 100 steps) shows as the gap between the peak after 5 steps
and the last one, which 5 steps alone never saw. This module chooses the contenders,
interleaves them round by round in fresh processes, and forms the comparisons: bytes of the
fullest rank (the one that decides whether a model fits), and per-round paired ratios of peak
RSS (the fullest rank's) and of step speed (1 / the slowest rank's step time).

Every contender gets cores / k threads and contiguous weights, because FSDP2 refuses
channels_last parameters ("FSDP does not support non-contiguous parameters yet"). phalanx's
workers run with its allocator setting (freed blocks stay on the heap), as `phalanx run` starts
them; DDP, ZeroRedundancyOptimizer and FSDP2 run as a user's own script does, with glibc's
allocator as it comes, so their peak RSS is the one a user of theirs sees (the table's first
line says so). A MALLOC_* variable in the environment (`MALLOC_PERTURB_=0` is glibc's own
default) leaves glibc's allocator as it comes to phalanx's workers too (runtime/binding.py); the
payload's `allocator` says which ran.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from phalanx.measure.memory import HELD
from phalanx.measure.mlp import MEMORY_MODELS, build_bench_model
from phalanx.measure.job_steps import StepJob
from phalanx.measure.step import Variant, run_variant
from phalanx.measure.timing import Spread, paired_ratio, run_interleaved
from phalanx.options import at_least, check_options, option
from phalanx.runtime.binding import available_cores, users_allocator_setting

# --contenders key: (name in the table, kind of measure/step.py, phalanx's shard stage)
CONTENDERS = {
    "ddp": ("DDP", "ddp", "none"),
    "zero": ("DDP + ZeroRedundancyOptimizer", "zero", "none"),
    "fsdp2": ("FSDP2 fully_shard", "fsdp2", "none"),
    "none": ("phalanx none", "phalanx", "none"),
    "optimizer": ("phalanx optimizer (ZeRO-1)", "phalanx", "optimizer"),
    "gradients": ("phalanx gradients (ZeRO-2)", "phalanx", "gradients"),
    "parameters": ("phalanx parameters (ZeRO-3)", "phalanx", "parameters"),
}
# FSDP2 makes CUDA streams in torch 2.4 and 2.5 (pytorch#136843 made them per device): on CPU
# workers it runs from 2.6, and before it is left out of the default contenders and refused by name.
FSDP2_ON_CPU = torch.__version__ >= (2, 6)
DEFAULT_CONTENDERS = tuple(key for key in CONTENDERS if key != "fsdp2" or FSDP2_ON_CPU)
# (numerator, denominator, held bytes compared): what each stage divides, and what ZeRO-1 / FSDP2 do.
BYTE_RATIOS = (("optimizer", "none", "optimizer_state"), ("gradients", "none", "gradients"),
               ("parameters", "none", "parameters"), ("zero", "ddp", "optimizer_state"),
               ("fsdp2", "ddp", "parameters"))
# Peak RSS (the whole run's): each stage against none, and against its PyTorch counterpart.
RSS_RATIOS = (("optimizer", "none"), ("gradients", "none"), ("parameters", "none"), ("optimizer", "zero"),
              ("parameters", "fsdp2"))
# Step speed: the stages against none; each phalanx stage against its PyTorch counterpart (ZeRO-2
# has none in PyTorch: DDP + ZeroRedundancyOptimizer, which keeps whole gradients, stands in).
SPEED_RATIOS = (("optimizer", "none"), ("gradients", "none"), ("parameters", "none"), ("none", "ddp"),
                ("optimizer", "zero"), ("gradients", "zero"), ("parameters", "fsdp2"))


@dataclass(frozen=True, kw_only=True)
class MemoryBenchConfig:
    """bytes per rank, peak RSS and step time: phalanx's ZeRO stages vs DDP, ZeroRedundancyOptimizer, FSDP2"""

    models: tuple[str, ...] = option(MEMORY_MODELS, items=str, choices=MEMORY_MODELS,
                                     help="models: mlp has 5.8 M parameters, mlp-wide 53.6 M")
    num_devices: int = option(2, flag="--devices", help="k, the processes of every contender",
                              check=at_least(2, problem="must be at least 2 (sharding over one device divides nothing)"))
    global_batch_size: int = option(128, flag="--batch-size", check=at_least(1), help="global batch")
    warmup_steps: int = option(2, check=at_least(0), help="untimed steps first")
    steps: int = option(20, check=at_least(1), help="timed steps per contender (the peak after 5 is reported too)")
    rounds: int = option(3, check=at_least(1), help="interleaved rounds, fresh processes each")
    contenders: tuple[str, ...] = option(DEFAULT_CONTENDERS, items=str, choices=tuple(CONTENDERS),
                                         help="ddp, zero (DDP + ZeroRedundancyOptimizer), fsdp2, and phalanx's none, "
                                              "optimizer, gradients, parameters")
    optimizer: str = "adam"
    lr: float = 1e-3
    seed: int = 0
    timeout_s: float = 300.0  # bound on one collective
    deadline_s: float = 1200.0  # bound on one configuration's processes

    def __post_init__(self) -> None:
        check_options(self)
        if len(set(self.contenders)) < len(self.contenders):
            raise ValueError(f"--contenders {','.join(self.contenders)} names one twice; name each once")
        if "fsdp2" in self.contenders and not FSDP2_ON_CPU:
            raise ValueError(f"--contenders fsdp2 cannot run on CPU workers with torch {torch.__version__}, whose "
                             "FSDP2 makes CUDA streams (torch 2.6 runs it on CPU): leave fsdp2 out, or upgrade torch")
        if self.global_batch_size < self.num_devices:
            raise ValueError(f"--batch-size {self.global_batch_size} is smaller than {self.num_devices} devices "
                             "(one example per device at least)")


def contender_variants(contenders: tuple[str, ...], num_devices: int, cores: int) -> dict[str, Variant]:
    """The chosen contenders as the kit's Variants: cores / k threads each, phalanx's allocator
    setting in phalanx's workers only (PyTorch's contenders run as a user's script does)."""
    threads = max(1, cores // num_devices)
    return {key: Variant(name=CONTENDERS[key][0], kind=CONTENDERS[key][1], shard=CONTENDERS[key][2],
                         num_procs=num_devices, threads_per_proc=threads, allocator_env=CONTENDERS[key][1] == "phalanx",
                         memory_format="contiguous")
            for key in contenders}


def parameter_count(model: str) -> int:
    """How many parameters `model` has (built on the meta device: no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in build_bench_model(model).parameters())


def run_memory_bench(config: MemoryBenchConfig, *, on_run: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run every (model, contender) once per round, interleaved; return the JSON payload."""
    cores = available_cores()
    variants = contender_variants(config.contenders, config.num_devices, cores)
    runs, started = {}, [0]
    total = config.rounds * len(config.models) * len(variants)
    for model in config.models:
        job = StepJob(model=model, global_batch_size=config.global_batch_size, warmup_steps=config.warmup_steps,
                      steps=config.steps, lr=config.lr, seed=config.seed, optimizer=config.optimizer)
        for key, variant in variants.items():
            def run(variant=variant, job=job) -> list[dict]:
                started[0] += 1
                if on_run is not None:
                    on_run(f"[{started[0]}/{total}] {job.model}: {variant.name}")
                return run_variant(variant, job, timeout_s=config.timeout_s, deadline_s=config.deadline_s)
            runs[(model, key)] = run
    samples = run_interleaved(runs, rounds=config.rounds, warmup_rounds=0)  # warm-up: steps in each process
    results, ratios = [], []
    for model in config.models:
        per = {key: summarize(samples[(model, key)], steps=config.steps) for key in variants}
        results += [{"model": model, "contender": key, "name": variants[key].name,
                     "num_parameters": parameter_count(model), **per[key]} for key in variants]
        ratios += [{"model": model, **ratio} for ratio in compare(per)]
    setting = users_allocator_setting()
    allocator = ("phalanx's workers with its allocator setting, PyTorch's contenders with glibc's allocator as it "
                 "comes (as a user's script runs them)" if setting is None else f"glibc's allocator ({setting} set)")
    return {"bench": "memory", "config": asdict(config), "cores": cores, "allocator": allocator,
            "variants": {key: asdict(v) for key, v in variants.items()}, "results": results, "ratios": ratios}


def _worst(ranks: list[dict], key: str) -> float | None:
    values = [r[key] for r in ranks if r.get(key) is not None]
    return float(max(values)) if values else None


def summarize(rounds: list[list[dict]], *, steps: int) -> dict[str, Any]:
    """One contender's rounds (each: every rank's record) as the payload's row: held bytes per
    rank (the most any round saw) and of the fullest rank; per round, the fullest rank's resident
    set before the model, peak (over the set-up, after the first steps, over the steps, over
    both) and the slowest rank's step time."""
    num_ranks = len(rounds[0])
    held = {part: [max(r[rank]["held_bytes"][part] for r in rounds) for rank in range(num_ranks)] for part in HELD}
    row: dict[str, Any] = {"held_bytes_per_rank": held,
                           "held_bytes": {part: max(values) for part, values in held.items()}}
    for key in ("rss_before_model_bytes", "setup_peak_rss_bytes", "early_steps_peak_rss_bytes", "steps_peak_rss_bytes",
                "peak_rss_bytes"):
        per_round = [_worst(ranks, key) for ranks in rounds]
        row[key] = None if None in per_round else Spread.of(per_round).to_dict()
    row["step_s"] = Spread.of([max(r["wall_s"] for r in ranks) / steps for ranks in rounds]).to_dict()
    row["ranks"] = [[{k: v for k, v in r.items() if k != "held_bytes"} for r in ranks] for ranks in rounds]
    return row


def compare(per: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The ratios among one model's rows (`summarize`'s, by contender key) whose two sides both
    ran: held bytes of the fullest rank (one number: the same every round), and the per-round
    ratios of peak RSS and of step speed."""
    out: list[dict[str, Any]] = []
    for top, bottom, part in BYTE_RATIOS:
        if top in per and bottom in per and per[bottom]["held_bytes"][part]:
            out.append({"metric": f"{part}_bytes", "numerator": top, "against": bottom,
                        "ratio": per[top]["held_bytes"][part] / per[bottom]["held_bytes"][part]})
    for top, bottom in RSS_RATIOS:
        if top in per and bottom in per and None not in (per[top]["peak_rss_bytes"], per[bottom]["peak_rss_bytes"]):
            ratio = paired_ratio(per[top]["peak_rss_bytes"]["samples"], per[bottom]["peak_rss_bytes"]["samples"])
            out.append({"metric": "peak_rss", "numerator": top, "against": bottom, "ratio": ratio.to_dict()})
    for top, bottom in SPEED_RATIOS:
        if top in per and bottom in per:  # speed = 1 / step time: the denominator's time over the numerator's
            ratio = paired_ratio(per[bottom]["step_s"]["samples"], per[top]["step_s"]["samples"])
            out.append({"metric": "step_speed", "numerator": top, "against": bottom, "ratio": ratio.to_dict()})
    return out
