"""The check: measure phalanx on k devices with `bench scaling`'s own phalanx contender.

The worker is the measuring kit's (phalanx/measure/step.py): k CPU workers started by
`phalanx.runtime.launch` (its allocator setting, cores // k threads each, at least 1),
DataParallel with the prediction's algorithm and bucket cap, channels_last for conv nets, one
fixed random global batch in memory, each rank training its `split_batch` shard with
`train_batch`; warm-up steps, a barrier, timed steps; images/s from the slowest rank's time. One
device runs in a fresh process of its own, as bench scaling's phalanx/1 does. Beside images/s it
notes how many cores other programs kept busy during the timed steps (the host's busy time minus
the workers' own CPU time, measure/load.py), so a prediction can be compared at the load the
measurement actually met.
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.measure.load import others_busy_cores
from phalanx.measure.job_steps import StepJob
from phalanx.measure.step import Variant, images_per_s, run_variant


@dataclass(frozen=True, kw_only=True)
class Measurement:
    images_per_s: float
    others_busy_cores: float  # cores other programs kept busy meanwhile (measure/load.py)


def measure_phalanx(job: StepJob, *, world_size: int, threads_per_device: int, algorithm: str, timeout_s: float,
                    deadline_s: float, overlap: bool | None = None) -> Measurement:
    """Images/s of phalanx on `world_size` CPU devices running `job` (the slowest rank's time
    counts), its exchange beside backward or after it as `overlap` says (None: auto, as training)."""
    variant = Variant(name=f"phalanx/{world_size}", kind="phalanx", num_procs=world_size,
                      threads_per_proc=threads_per_device, allocator_env=True, memory_format="auto",
                      algorithm=algorithm, overlap=overlap)
    windows = run_variant(variant, job, timeout_s=timeout_s, deadline_s=deadline_s)
    return Measurement(images_per_s=images_per_s(job, windows), others_busy_cores=others_busy_cores(windows))
