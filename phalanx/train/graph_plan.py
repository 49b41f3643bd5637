"""Whether a run's step is captured as a CUDA graph, and the words its first log line says about it.

`--cuda-graphs auto` (the default) captures the step where the run allows it - one CUDA device,
the data split, the plain step - and otherwise runs eagerly, naming the first thing that stands
in the way; `on` insists (a refusal is then a usage error, before anything runs); `off` runs
eagerly. `refusal(facts)` is the one list of what cannot be captured and why, in the order a
reader would look for it; `plan(mode, facts)` decides; `GraphPlan.describe()` is the first log
line's piece (STYLE habit 14: which capture ran is named, and a flag turns it off). The capture
itself is graphs.py's. Nothing here needs a GPU: the plan is a function of the run's settings.
"""

from __future__ import annotations

from dataclasses import dataclass

GRAPH_MODES = ("auto", "on", "off")
THREADED_ALLREDUCES = ("ring", "tree", "naive")


@dataclass(frozen=True, kw_only=True)
class StepFacts:
    """What about a run decides whether its step can be captured."""

    device_type: str  # "cuda", "cpu"
    num_devices: int
    split: str = "data"  # --split
    grad_accum_steps: int = 1
    tracing: bool = False  # --trace
    sync_batchnorm: bool = False  # a model whose BatchNorm is synchronised across devices
    allreduce: str = "auto"  # --allreduce as asked
    backend: str = "nccl"  # the world's backend where num_devices > 1
    lr_changes_every_step: bool = False  # lr warmup
    exchanging: bool = False  # one device whose replica exchanges anyway (a comm handed in)


def refusal(facts: StepFacts) -> str | None:
    """Why the step of a run with `facts` is not captured, in one phrase; None when it can be."""
    if facts.device_type != "cuda":
        return f"CUDA graphs need CUDA devices; this run is on {facts.device_type}"
    if facts.split != "data":
        return f"--split {facts.split} runs its own schedule of sends and receives between the parts"
    if facts.grad_accum_steps > 1:
        return f"--grad-accum {facts.grad_accum_steps} runs micro-batches under no_sync, a step of its own shape"
    if facts.tracing:
        return "--trace times each step's spans on the host, and a replayed graph runs no Python"
    if facts.sync_batchnorm:
        return "SyncBatchNorm reads each layer's example count on the host every step"
    if facts.num_devices > 1 and facts.allreduce in THREADED_ALLREDUCES:
        return f"--allreduce {facts.allreduce} runs on a Python thread with point-to-point messages"
    if facts.num_devices > 1 and facts.backend == "gloo":
        return "gloo (ranks sharing one GPU) cannot be captured; NCCL can"
    if facts.lr_changes_every_step:
        return "lr warmup changes the lr every step, and the captured optimizer kernels hold it as a number"
    if facts.num_devices > 1:
        return (f"{facts.num_devices} GPUs: a replayed graph would hide its NCCL allreduces from phalanx's collective "
                "watchdog; the captured exchange awaits a multi-GPU machine to be tested on")
    if facts.exchanging:
        return "this one-device replica exchanges its gradients (a comm was handed in)"
    return None


@dataclass(frozen=True, kw_only=True)
class GraphPlan:
    mode: str
    capture: bool
    reason: str | None  # why not, when capture is False
    device_type: str

    def describe(self) -> str:
        """The first log line's piece: what runs the step, or nothing for a CPU run left on auto."""
        if self.capture:
            return ", step captured as one CUDA graph (each full batch; the smaller last batch eager)"
        if self.mode == "auto" and self.device_type != "cuda":
            return ""
        return f", eager step ({'--cuda-graphs off' if self.mode == 'off' else self.reason})"


def plan(mode: str, facts: StepFacts) -> GraphPlan:
    """Decide: `on` with a refusal raises ValueError naming it and the fix; `auto` runs eagerly then."""
    if mode not in GRAPH_MODES:
        raise ValueError(f"--cuda-graphs {mode!r} is unknown; choose one of {', '.join(GRAPH_MODES)}")
    why = refusal(facts) if mode != "off" else None
    if mode == "on" and why is not None:
        raise ValueError(f"--cuda-graphs on: {why}; use --cuda-graphs auto to run such a step eagerly")
    return GraphPlan(mode=mode, capture=mode != "off" and why is None, reason=why, device_type=facts.device_type)


__all__ = ["GRAPH_MODES", "GraphPlan", "StepFacts", "plan", "refusal"]
