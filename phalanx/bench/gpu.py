"""`phalanx bench gpu`: images/s on one GPU, phalanx against the plain PyTorch loop, eager and captured.

The chapter's own workload (LeNet, 60,000 images resident on the GPU, global batch 256), five
contenders in the shape of `bench scaling`: phalanx eager (`--cuda-graphs off`), phalanx with
its step captured (`on`), the plain loop, the plain loop with its whole step captured as one
CUDA graph (PyTorch's recipe; it drops each epoch's smaller last batch), and torch DDP in a world
of one (NCCL). Each runs in a fresh process per round, interleaved; images/s counts the images
a contender trained over its timed epochs (phalanx/measure/one_device.py).

Beyond the anchors, `--variants` times phalanx's captured step with one change each - a fused
SGD, channels_last, a bfloat16 autocast forward, `torch.compile` of the model inside the graph -
and "compile" also as the alternative to capture (phalanx eager + compile), each beside a fresh
run of phalanx's captured step, `--variant-rounds` times: what phalanx's CUDA defaults should
become is read from these ratios. Rounds run most telling first - one of the anchors, the
variants', then the anchors' others - and one that would end past `--budget-s` (170 s) is not
started, so the bench stays under 3 minutes on one GPU whatever its start-up costs there; each
round's images/s are printed as it ends (stderr), so a bench stopped from outside still leaves them.
The check: every captured phalanx run replayed its graph to the end (a capture that fell back to
eager is named, and the command exits 1). Without a GPU it refuses in one line (exit 2); `bench
step` is the host-time proxy any CPU can run.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

import torch

from phalanx.measure.one_device import OneDeviceJob, run_contenders
from phalanx.measure.timing import Spread, paired_ratio
from phalanx.models import MODELS
from phalanx.options import at_least, check_options, option, positive

VARIANTS = ("fused", "channels_last", "bf16", "compile")
BASE = ("phalanx eager", "phalanx graphs", "plain", "plain captured", "ddp/1")
# (metric, numerator, denominator) over the base contenders
RATIOS = (("phalanx_eager_vs_plain", "phalanx eager", "plain"), ("phalanx_graphs_vs_plain", "phalanx graphs", "plain"),
          ("phalanx_graphs_vs_plain_captured", "phalanx graphs", "plain captured"),
          ("plain_captured_vs_plain", "plain captured", "plain"), ("ddp_vs_plain", "ddp/1", "plain"))


@dataclass(frozen=True, kw_only=True)
class GpuBenchConfig:
    """images/s on one GPU: phalanx eager and captured vs the plain loop, captured or not, and DDP"""

    model: str = option("lenet", choices=MODELS, help="the model")
    global_batch_size: int = option(256, flag="--batch-size", check=at_least(1), help="global batch")
    num_images: int = option(60_000, flag="--images", check=at_least(1), help="images resident on the GPU (an epoch)")
    warmup_epochs: int = option(1, check=at_least(0), help="untimed epochs first, in every process")
    epochs: int = option(2, check=at_least(1), help="timed epochs per process")
    rounds: int = option(3, check=at_least(1), help="interleaved rounds of the five contenders, fresh processes")
    variants: tuple[str, ...] = option(VARIANTS, items=str, choices=VARIANTS, help="changes to phalanx's captured "
                                       "step also timed (compile: also instead of the capture)")
    variant_rounds: int = option(1, check=at_least(0), help="rounds of the variants, each beside phalanx's "
                                 "captured step; 0: none")
    budget_s: float = option(170.0, check=positive("number of seconds"), help="start no round that would end past "
                             "this many seconds (at least one round of every contender runs)")
    deadline_s: float = 300.0  # bound on one contender's process (a first torch.compile takes tens of seconds)

    def __post_init__(self) -> None:
        check_options(self)
        if len(set(self.variants)) != len(self.variants):
            raise ValueError(f"--variants {','.join(self.variants)}: name each one once")
        if self.global_batch_size > self.num_images:
            raise ValueError(f"--batch-size {self.global_batch_size} is larger than --images {self.num_images}")

    def prepare(self) -> "GpuBenchConfig":
        """Refuse where no GPU is present, before anything is written."""
        if not torch.cuda.is_available():
            raise ValueError("bench gpu needs a CUDA GPU, and torch sees none; `phalanx bench step` measures "
                             "the host time per step on this CPU")
        return self

    def job(self, kind: str, **changes) -> OneDeviceJob:
        return OneDeviceJob(kind=kind, device="cuda", model=self.model, num_images=self.num_images,
                            global_batch_size=self.global_batch_size, warmup_epochs=self.warmup_epochs,
                            epochs=self.epochs, **changes)


def contenders(config: GpuBenchConfig) -> tuple[dict[str, OneDeviceJob], dict[str, OneDeviceJob]]:
    """The five anchors, and the variant group: phalanx's captured step beside each variant."""
    graphs = config.job("phalanx", graphs=True)
    base = {"phalanx eager": config.job("phalanx"), "phalanx graphs": graphs, "plain": config.job("plain"),
            "plain captured": config.job("plain", graphs=True), "ddp/1": config.job("ddp")}
    variants = {f"phalanx graphs + {name}": replace(graphs, **{name: True}) for name in config.variants}
    if "compile" in config.variants:
        variants["phalanx eager + compile"] = config.job("phalanx", compile=True)
    return base, ({"phalanx graphs": graphs, **variants} if variants and config.variant_rounds else {})


def images_per_s(record: dict[str, Any]) -> float:
    return sum(record["images"]) / sum(record["wall_s"])


def plan_rounds(config: GpuBenchConfig, groups: dict[str, dict[str, OneDeviceJob]]) -> list[str]:
    """The order rounds run in, most telling first: one round of the anchors, the variants' rounds,
    then the anchors' other rounds - so a time budget cut short still leaves every contender timed."""
    order = ["anchors"] if config.rounds else []
    order += ["variants"] * config.variant_rounds if groups["variants"] else []
    return order + ["anchors"] * (config.rounds - 1)


def run_gpu_bench(config: GpuBenchConfig, *, on_run: Callable[[str], None] | None = None,
                  clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """The rounds of `plan_rounds`, each interleaved in fresh processes, while `budget_s` lasts (a
    round is started only if the seconds its processes took so far, on average, fit); the payload."""
    base, variant_group = contenders(config)
    groups = {"anchors": base, "variants": variant_group}
    records: dict[str, dict[str, list]] = {"anchors": {}, "variants": {}}
    started_s, processes, skipped = clock(), 0, []
    for group in plan_rounds(config, groups):
        jobs = groups[group]
        per_process_s = (clock() - started_s) / processes if processes else 0.0
        if processes and clock() - started_s + per_process_s * len(jobs) > config.budget_s:
            skipped.append(group)
            continue
        done = run_contenders(jobs, rounds=1, deadline_s=config.deadline_s, on_run=on_run)
        for name, runs in done.items():
            records[group].setdefault(name, []).extend(runs)
        processes += len(jobs)
        if on_run is not None:  # the round's figures as it ends: a bench stopped later still leaves them
            on_run(f"{group} round, images/s: " + ", ".join(f"{name} {images_per_s(runs[-1]):.0f}"
                                                             for name, runs in done.items()))
    results, ratios, problems = [], [], []
    for group, by_name in records.items():
        rates = {name: [images_per_s(r) for r in runs] for name, runs in by_name.items()}
        for name, runs in by_name.items():
            states = sorted({r["graph"] for r in runs if r["graph"] is not None})
            results.append({"group": group, "contender": name, "rounds": len(runs),
                            "images_per_s": Spread.of(rates[name]).to_dict(),
                            "host_s_per_epoch": Spread.of([sum(r["host_s"]) / len(r["host_s"]) for r in runs]).to_dict(),
                            "graph": states, "notes": sorted({n for r in runs for n in r["notes"]})})
            if groups[group][name].graphs and states != ["replaying"]:
                problems.append(f"{name}: the captured step ran {', '.join(states)} "
                                f"({'; '.join(results[-1]['notes']) or 'no reason given'})")
        pairs = RATIOS if group == "anchors" else [(f"{name}_vs_phalanx_graphs", name, "phalanx graphs")
                                                   for name in by_name if name != "phalanx graphs"]
        ratios += [{"group": group, "metric": metric, "numerator": a, "against": b,
                    "ratio": paired_ratio(rates[a], rates[b]).to_dict()} for metric, a, b in pairs if a in rates]
    return {"bench": "gpu", "config": asdict(config), "where": where(), "results": results, "ratios": ratios,
            "elapsed_s": clock() - started_s, "rounds_skipped": skipped,
            "check": {"passed": not problems, "problems": problems}}


def gpu_failed(payload: dict[str, Any]) -> str | None:
    """Why the run failed its check (exit 1), or None."""
    check = payload["check"]
    return None if check["passed"] else f"gpu: the check FAILED: {'; '.join(check['problems'])}"


def where() -> str:
    return (f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
            if torch.cuda.is_available() else "no GPU")


__all__ = ["BASE", "GpuBenchConfig", "VARIANTS", "contenders", "gpu_failed", "run_gpu_bench"]
