"""Where phalanx/k's step loses to its lockstep twin, and which change would win it back: one start
of k workers taking turns, phase by phase (measure/phases.py), with the suspects as contenders.

    .venv/bin/python tools/gap_probe.py [--model lenet|mlp] [--devices 8] [--threads 2] [--batch-sizes 256,1024]
                                        [--blocks 8] [--contenders lockstep-full,phalanx,...]

Contenders, side by side in the same workers (measure/side_by_side.py): the lockstep twin (the plain
step, a 4-byte meeting after backward); the twin meeting through an allreduce as large as phalanx's
gradient (what the collective alone costs inside a step: from it to phalanx is phalanx's replica);
phalanx as `bench scaling` runs it; phalanx without the NaN/Inf check; phalanx whose shm rounds sum
and copy on the training thread's intra-op team at any size (the compiled kernel works on one
thread, and LeNet's 504 KB bucket sits just below the team's threshold; a worker of one thread has
no team and runs as phalanx does); phalanx whose shm waits spin 1 ms before a futex sleep, not 50 us
(a large round at 8 ranks waits twice, and a rank woken from a sleep may have left its core);
phalanx overlapped (its exchange beside backward on a thread of its own). Each line: ms a step per
phase (each block the ranks' mean, the median of blocks) and the step's time against the twin's (the
median of per-block ratios of the slowest rank's blocks). On 16 cores, 8 x 2 threads, phalanx/8 ran
1.5 / 3.2 ms a step beyond its twin at batch 256 / 1024 (0.82 / 0.90 of its images/s, 2026-12-04):
this says which phase that is and what each change buys.
"""

from __future__ import annotations

import argparse

from phalanx.measure.job_steps import StepJob
from phalanx.measure.side_by_side import run_side_by_side
from phalanx.measure.timing import paired_ratio

CONTENDERS = {"lockstep twin": "lockstep", "twin, gradient-sized meeting": "lockstep-full", "phalanx": "phalanx",
              "phalanx, no NaN/Inf check": "unchecked", "phalanx, rounds on the team": "team-rounds",
              "phalanx, waits spin 1 ms": "long-spin", "phalanx overlapped": "overlapped"}


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the probe; print and return a row per (batch size, contender): ms a step per phase, and
    the step's time against the twin's."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="lenet", choices=("lenet", "mlp"),
                        help="mlp: 5.8 M parameters, a 23 MB gradient, where the exchange's bytes weigh")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads per worker")
    parser.add_argument("--batch-sizes", default="256,1024")
    parser.add_argument("--contenders", default=",".join(CONTENDERS.values()),
                        help="which, by kind (the lockstep twin always runs: the yardstick)")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6, help="steps per block")
    args = parser.parse_args(argv)
    kinds = {"lockstep", *args.contenders.split(",")}
    unknown = kinds - set(CONTENDERS.values())
    if unknown:
        parser.error(f"unknown contender {sorted(unknown)[0]!r}; choose from {', '.join(CONTENDERS.values())}")
    chosen = {name: kind for name, kind in CONTENDERS.items() if kind in kinds}
    jobs = [StepJob(model=args.model, global_batch_size=int(b), warmup_steps=2, steps=args.steps, lr=0.2, seed=0,
                    num_shards=args.devices, threads_per_device=args.threads, memory_format="auto")
            for b in args.batch_sizes.split(",")]
    rows = []
    for job in jobs:  # a start each, its lines printed as it ends: a deadline that cuts the next loses only that
        (result,) = run_side_by_side([job], list(chosen.values()), num_procs=args.devices,
                                     threads_per_proc=args.threads, blocks=args.blocks, timeout_s=120, deadline_s=540)
        print(f"{args.model}, {args.devices} x {args.threads} threads, global batch {job.global_batch_size}: ms a step, and the "
              f"step's time / the twin's ({args.blocks} blocks of {job.steps} steps)")
        twin = result.seconds["lockstep"]
        for name, kind in chosen.items():
            ms = result.phase_ms[kind]
            ratio = paired_ratio(result.seconds[kind], twin).median
            phases = "  ".join(f"{phase} {value:6.2f}" for phase, value in ms.items())
            print(f"  {name:<28} {phases}  step {sum(ms.values()):6.2f}  / twin's {ratio:.3f}", flush=True)
            rows.append({"model": args.model, "global_batch_size": job.global_batch_size, "contender": name, "ms_per_step": ms,
                         "step_vs_twin": ratio})
    return rows


if __name__ == "__main__":
    main()
