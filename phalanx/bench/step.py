"""`phalanx bench step`: host time per step on one device, phalanx's step against the plain PyTorch loop.

What phalanx's one-device step costs beyond the plain loop's (`zero_grad(set_to_none=True)`,
`X[idx].float() / 255`, forward, cross-entropy, backward, `step()`), measured where it shows:
at a small batch on one thread the kernels are small, so Python and dispatch weigh as they do
on a GPU, whose step LeNet's ~40 launches bound by the host. Any CPU can run it, so the ratio
stays visible without a GPU (`bench gpu` is the same pair on a GPU, in images/s, with the
captured steps beside it). Both contenders train LeNet on the same resident data in the same
layout (contiguous) and process set-up (threads, allocator), each in a fresh process per round,
interleaved (phalanx/measure/one_device.py); the main thread's CPU seconds per step are the
host time (what another job on a shared machine takes shows in the wall time, much less in
this). The verdict is the median of the per-round ratios phalanx / plain and the median extra
microseconds per step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from phalanx.measure.one_device import OneDeviceJob, run_contenders
from phalanx.measure.outputs import format_table, median_whiskers, new_figure
from phalanx.measure.timing import Spread, paired_ratio
from phalanx.models import MODELS
from phalanx.options import at_least, check_options, option

CONTENDERS = ("phalanx", "plain")


@dataclass(frozen=True, kw_only=True)
class StepBenchConfig:
    """host time per step on one device: phalanx's step vs the plain PyTorch loop"""

    device: str = option("cpu", choices=("cpu", "cuda"), help="where the steps run")
    model: str = option("lenet", choices=MODELS, help="the model")
    global_batch_size: int = option(8, flag="--batch-size", check=at_least(1),
                                    help="global batch (small: the host's share of a step is largest)")
    steps: int = option(200, check=at_least(1), help="steps per epoch (the resident data set is steps x batch images)")
    warmup_epochs: int = option(1, check=at_least(0), help="untimed epochs first, in every process")
    epochs: int = option(2, check=at_least(1), help="timed epochs per process")
    threads: int = option(1, check=at_least(1), help="CPU intra-op threads of each contender")
    rounds: int = option(7, check=at_least(1), help="interleaved rounds, a fresh process per contender each")
    deadline_s: float = 600.0  # bound on one contender's process

    def __post_init__(self) -> None:
        check_options(self)

    def prepare(self) -> "StepBenchConfig":
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("bench step --device cuda needs a CUDA GPU, and torch sees none; use --device cpu")
        return self

    def job(self, kind: str) -> OneDeviceJob:
        return OneDeviceJob(kind=kind, device=self.device, model=self.model, num_images=self.steps * self.global_batch_size,
                            global_batch_size=self.global_batch_size, warmup_epochs=self.warmup_epochs,
                            epochs=self.epochs, threads=self.threads)


def per_step_us(record: dict[str, Any], key: str, steps: int) -> float:
    """Microseconds of `key` (wall_s or host_s) per step over a record's timed epochs."""
    return 1e6 * sum(record[key]) / (steps * len(record[key]))


def run_step_bench(config: StepBenchConfig, *, on_run: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Both contenders once per round, interleaved, fresh processes; the JSON payload."""
    samples = run_contenders({name: config.job(name) for name in CONTENDERS}, rounds=config.rounds,
                             deadline_s=config.deadline_s, on_run=on_run)
    per = {name: {key: [per_step_us(r, key, config.steps) for r in records] for key in ("host_s", "wall_s")}
           for name, records in samples.items()}
    extra = [a - b for a, b in zip(per["phalanx"]["host_s"], per["plain"]["host_s"])]
    return {"bench": "step", "config": asdict(config), "where": _where(config),
            "results": [{"contender": name, "host_us_per_step": Spread.of(per[name]["host_s"]).to_dict(),
                         "wall_us_per_step": Spread.of(per[name]["wall_s"]).to_dict()} for name in CONTENDERS],
            "ratios": {key: paired_ratio(per["phalanx"][key], per["plain"][key]).to_dict()
                       for key in ("host_s", "wall_s")},
            "extra_host_us_per_step": Spread.of(extra).to_dict()}


def _where(config: StepBenchConfig) -> str:
    if config.device == "cuda":
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    return f"CPU, {config.threads} thread{'s' if config.threads > 1 else ''}, torch {torch.__version__}"


def report_step(payload: dict[str, Any]) -> str:
    config = payload["config"]
    rows = [(r["contender"], Spread.from_dict(r["host_us_per_step"]).fmt(0), Spread.from_dict(r["wall_us_per_step"]).fmt(0))
            for r in payload["results"]]
    host, wall = (Spread.from_dict(payload["ratios"][k]) for k in ("host_s", "wall_s"))
    extra = Spread.from_dict(payload["extra_host_us_per_step"])
    return "\n".join([
        f"{config['model']}, batch {config['global_batch_size']}, on {payload['where']}: us per step, median (min-max) "
        f"of {config['rounds']} interleaved rounds, {config['epochs']} x {config['steps']} timed steps each", "",
        format_table(["contender", "host us/step", "wall us/step"], rows), "",
        f"phalanx's step / the plain loop's: host {host.fmt(3)}, wall {wall.fmt(3)}",
        f"phalanx's step spends {extra.fmt(0)} us more host time than the plain loop's"])


def plot_step(payload: dict[str, Any]):
    fig, (ax,) = new_figure(1, width_per_plot=5.0, height=2.6)
    names = [r["contender"] for r in payload["results"]]
    medians, whiskers = median_whiskers(payload["results"], "host_us_per_step")
    ax.barh(names, medians, xerr=whiskers, color=["tab:blue", "tab:gray"], capsize=3)
    ax.invert_yaxis()
    ax.set_xlabel("host us per step (median, min-max)")
    config = payload["config"]
    ax.set_title(f"{config['model']}, batch {config['global_batch_size']}, {payload['where']}", fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    return fig


__all__ = ["StepBenchConfig", "plot_step", "report_step", "run_step_bench"]
