"""`phalanx bench scaling --side-by-side`: its rounds of shared starts (the contenders and ratios
are scaling.py's; how a start runs its contenders in turns is measure/side_by_side.py's).

The contenders that share phalanx's set-up run in one start per set (`side_by_side_sets`): phalanx/k
with its overlapped, core-left, ceiling, lockstep and DDP twins; phalanx/j alone for every other
count of --devices; phalanx/1 beside the tuned plain loop. A round is one start of each set. Each
start gives images/s of every block, and where each contender's step went (forward, backward,
wait, optimizer, other: measure/phases.py), kept per round in the JSON's "phases".
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable, Sequence

from phalanx.measure.job_steps import StepJob
from phalanx.measure.side_by_side import run_side_by_side
from phalanx.measure.step import Variant
from phalanx.measure.timing import Spread


# The contenders that share phalanx's set-up, by name, and the kind each runs as in
# side_by_side.py; the names are scaling.variants()' own, so the table shows each one's set-up.
# Every other count of --devices gets a start of phalanx/j alone: its speed-up over phalanx/1, whose
# start takes turns with it within seconds, where separate runs of one command differ by 10-40%.
def side_by_side_sets(counts: Sequence[int], cores: int) -> list[tuple[str, dict[str, str]]]:
    k = max(counts)
    tuned = f"torch {cores} thread{'s' if cores > 1 else ''} tuned"
    left = {f"phalanx/{k} core left": "core-left"} if cores // k > 1 else {}  # runs one thread below the start's
    between = [(f"phalanx/{j}", {f"phalanx/{j}": "phalanx"}) for j in sorted(set(counts) - {1, k})]
    return [(f"phalanx/{k}", {f"phalanx/{k}": "phalanx", f"phalanx/{k} overlapped": "overlapped", **left,
                              f"ceiling/{k}": "ceiling", f"ceiling/{k} lockstep": "lockstep", f"ddp/{k} tuned": "ddp"}),
            *between, ("phalanx/1", {"phalanx/1": "phalanx", tuned: "torch"})]


def side_by_side_rounds(contenders: list[Variant], jobs: tuple[StepJob, ...], *, device_counts: Sequence[int],
                        cores: int, rounds: int, blocks: int, timeout_s: float, deadline_s: float,
                        on_run: Callable[[str], None] | None = None):
    """Each round, one start per set of contenders sharing a set-up. Returns the contenders that
    ran, images/s of every block by "batch|name", each start's wall seconds by name, and the
    phase rows: per round, batch and contender, milliseconds per step of each phase."""
    by_name = {v.name: v for v in contenders}
    sets = side_by_side_sets(device_counts, cores)
    samples = {f"{job.global_batch_size}|{name}": [] for job in jobs for _, kinds in sets for name in kinds}
    wall_s: dict[str, list[float]] = {name: [] for _, kinds in sets for name in kinds}
    phases: list[dict[str, Any]] = []
    total = rounds * len(sets)
    for index in range(total):
        lead, kinds = sets[index % len(sets)]
        variant = by_name[lead]
        set_jobs = tuple(replace(job, num_shards=variant.num_procs, threads_per_device=variant.threads_per_proc,
                                 memory_format=variant.memory_format, algorithm=variant.algorithm,
                                 check_finite_every=variant.check_finite_every, shard=variant.shard,
                                 overlap=variant.overlap) for job in jobs)
        start_s = time.perf_counter()
        results = run_side_by_side(set_jobs, list(kinds.values()), num_procs=variant.num_procs,
                                   threads_per_proc=variant.threads_per_proc, blocks=blocks, timeout_s=timeout_s,
                                   deadline_s=deadline_s)
        elapsed_s = time.perf_counter() - start_s
        rates = []
        for job, result in zip(set_jobs, results):
            medians = []
            for name, kind in kinds.items():
                speeds = [job.global_batch_size * job.steps / s for s in result.seconds[kind]]
                samples[f"{job.global_batch_size}|{name}"] += speeds
                medians.append(f"{name} {Spread.of(speeds).median:.0f}")
                phases.append({"round": index // len(sets), "global_batch_size": job.global_batch_size,
                               "variant": name, "ms_per_step": result.phase_ms[kind]})
            rates.append(f"global batch {job.global_batch_size}: {', '.join(medians)}")
        for name in kinds:
            wall_s[name].append(elapsed_s)
        if on_run is not None:
            on_run(f"[{index + 1}/{total}] side by side on {variant.num_procs} x {variant.threads_per_proc} threads, "
                   f"images/s (median of {blocks} blocks): {', '.join(rates)} ({elapsed_s:.1f} s)")
    names = [name for _, kinds in sets for name in kinds]
    return [by_name[name] for name in names], samples, wall_s, phases
