"""Contenders with one set-up timed side by side: all of them in the same processes, taking turns.

bench scaling's default starts every contender in fresh processes of its own, round after round;
on a shared host two starts of the same program differ by 10-25% (where the scheduler put the
workers, what else ran), more than the few percent between phalanx and its ceiling. Contenders
that share phalanx's set-up - the same processes, threads, allocator setting, memory format and
shard - can instead run inside one start: each rank builds every contender (phalanx's replica,
the ceiling's plain model, the lockstep ceiling's, DDP's), warms each up, then they take turns
in blocks of `steps` steps, the order rotated every block, every rank meeting at a barrier before
each block. A block's time is its slowest rank's, as a lockstep step's is; the ratio of two
contenders is the median of their per-block ratios, so both sides of a ratio ran within seconds
of each other on the same cores.

Kinds: `phalanx` (prepare + train_batch), `overlapped` (the same with overlap=True, which auto turns
off for shm where the workers' threads fill the cores), `core-left` (phalanx built and stepped with
one intra-op thread fewer, as `--threads-per-device` one below cores / k runs: a core per worker
left to the host and, auto decides, a communication thread), `unchecked` (phalanx without its
NaN/Inf check), `team-rounds` (phalanx with its shm rounds on the training thread's intra-op team at
any size: `on_team`), `long-spin` (phalanx whose shm waits spin 1 ms, not 50 us, before they sleep;
these three are tools/gap_probe.py's), `ceiling` (the plain step, phalanx's scaled loss, no
exchange), `lockstep` (the ceiling meeting at every step through a 4-byte allreduce of phalanx's
auto algorithm), `lockstep-full` (the same meeting as large as phalanx's gradient: the collective's
own cost in a training step, without phalanx's replica), `ddp` (torch DDP over the world's default
gloo group, mean loss), `torch` (the plain step in one process: the ceiling of one). What one
process's contenders share - the allocator, caches, the communication thread an overlapped replica
keeps (asleep on a futex while the others run) - they share alike; the JSON says the method
(docs/benchmarks.md). Every contender's step also sums its phases on each rank (forward, backward,
wait, optimizer: phases.py), so a ratio below 1 comes with where the step went.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from typing import Callable, Iterator, NamedTuple, Sequence

import torch

from phalanx.comm import shm, shm_kernel
from phalanx.measure.job_steps import (OPTIMIZERS, StepJob, build_model, lockstep_meeting, phalanx_step,
                                       plain_optimizer, plain_step, prepare_replica, world_barrier)
from phalanx.measure.phases import PhaseClock, phase_ms_per_step, with_other
from phalanx.measure.procs import run_fresh
from phalanx.measure.timing import intra_op_threads
from phalanx.runtime.devices import parse_devices
from phalanx.runtime.launch import LaunchSpec, launch
from phalanx.runtime.world import World

SIDE_BY_SIDE_KINDS = ("phalanx", "overlapped", "core-left", "unchecked", "team-rounds", "long-spin", "ceiling",
                      "lockstep", "lockstep-full", "ddp", "torch")
LONG_SPIN_S = 1e-3  # the long-spin kind's busy wait before a futex sleep (shm_flags.SPIN_S: 50 us)


def _stepper(kind: str, job: StepJob, world: World, stack: contextlib.ExitStack,
             meet: Callable[[], object] | None, clock: PhaseClock) -> Callable[[], None]:
    """One contender's step on this rank, its model and optimizer built fresh from the job's seed,
    its phases summed on `clock`."""
    if kind == "core-left":
        return with_threads(max(1, torch.get_num_threads() - 1),
                            lambda: _stepper("phalanx", job, world, stack, meet, clock))
    if kind == "team-rounds":
        return on_team(_stepper("phalanx", job, world, stack, meet, clock))
    if kind == "long-spin":
        with _set_for(shm, "SPIN_S", LONG_SPIN_S):  # read where the replica's shm group opens, at prepare
            return _stepper("phalanx", job, world, stack, meet, clock)
    torch.manual_seed(job.seed)
    if kind in ("phalanx", "overlapped", "unchecked"):
        changed = {"overlapped": replace(job, overlap=True), "unchecked": replace(job, check_finite_every=0)}
        dp = stack.enter_context(prepare_replica(changed.get(kind, job), world))
        return phalanx_step(dp, dp.optimizer(OPTIMIZERS[job.optimizer], lr=job.lr), job, rank=world.rank, clock=clock)
    model = build_model(job)
    if kind == "lockstep-full":  # a meeting as large as the gradient phalanx exchanges, on a comm of its own
        kind, meet = "lockstep", lockstep_meeting(world, stack, numel=sum(p.numel() for p in model.parameters()))
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    return plain_step(model, plain_optimizer(model.parameters(), job), job, rank=world.rank, mean_loss=kind == "ddp",
                      meet=meet if kind == "lockstep" else None, clock=clock)


def on_team(step: Callable[[], None]) -> Callable[[], None]:
    """`step` with the shm rounds on torch's ops, the thread's intra-op team, at any size
    (shm_kernel.TEAM_NUMEL lowered around it): where the compiled kernel's one thread loses to a
    team, and where not (a worker of one thread has no team: the same step)."""
    def teamed() -> None:
        with _set_for(shm_kernel, "TEAM_NUMEL", 0):
            step()
    return teamed


@contextlib.contextmanager
def _set_for(module: object, name: str, value: object) -> Iterator[None]:
    """`module.name` is `value` inside the block (a knob a measurement kind turns), restored after."""
    kept = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, kept)


def with_threads(threads: int, build: Callable[[], Callable[[], None]]) -> Callable[[], None]:
    """`build()`'s step, built and run with `threads` intra-op threads (what a replica's auto
    settings read at prepare, what its steps use), this process's count restored around both."""
    with intra_op_threads(threads):
        step = build()

    def fewer() -> None:
        with intra_op_threads(threads):
            step()
    return fewer


class Turns(NamedTuple):
    """One rank's blocks, by kind: each block's seconds, and its seconds per phase (phases.py)."""

    seconds: dict[str, list[float]]
    phases: dict[str, list[dict[str, float]]]


def take_turns(steppers: dict[str, Callable[[], None]], job: StepJob, blocks: int,
               barrier: Callable[[], object], clocks: dict[str, PhaseClock] | None = None) -> Turns:
    """Warm-up steps of each, then `blocks` blocks of `job.steps` steps of each in turn, the order
    rotated every block: this rank's seconds per block, by kind, and what each kind's `clocks`
    summed per phase in each block (the rest of the block as phases.OTHER)."""
    clocks = clocks or {}
    for kind, step in steppers.items():
        for _ in range(job.warmup_steps):
            step()
        if kind in clocks:
            clocks[kind].take()  # the warm-up's phases dropped
    kinds = list(steppers)
    turns = Turns({kind: [] for kind in kinds}, {kind: [] for kind in kinds if kind in clocks})
    for block in range(blocks):
        shift = block % len(kinds)
        for kind in kinds[shift:] + kinds[:shift]:
            barrier()  # every rank starts the block together
            start = time.perf_counter()
            for _ in range(job.steps):
                steppers[kind]()
            block_s = time.perf_counter() - start
            turns.seconds[kind].append(block_s)
            if kind in clocks:
                turns.phases[kind].append(with_other(clocks[kind].take(), block_s))
    return turns


def _worker(world: World, jobs: tuple[StepJob, ...], kinds: tuple[str, ...], blocks: int) -> list[Turns]:
    """Every job in turn (a batch size each): its contenders built, warmed up and timed in blocks."""
    out = []
    with contextlib.ExitStack() as comms:
        meet = lockstep_meeting(world, comms) if "lockstep" in kinds else None  # one for every job
        for job in jobs:
            with contextlib.ExitStack() as stack:  # each job's replicas closed before the next's
                clocks = {kind: PhaseClock() for kind in kinds}
                steppers = {kind: _stepper(kind, job, world, stack, meet, clocks[kind]) for kind in kinds}
                out.append(take_turns(steppers, job, blocks, world_barrier(world), clocks))
    return out


def _single(*, rank: int, num_procs: int, port: int, job: tuple) -> list[Turns]:
    # One device runs in the launcher's own process; this fresh process stands in for it.
    jobs, kinds, blocks = job
    spec = LaunchSpec(plan=parse_devices("cpu:1", cuda_count=0), threads_per_device=jobs[0].threads_per_device)
    return launch(_worker, jobs, kinds, blocks, spec=spec)[0]


class SideBySide(NamedTuple):
    """One job's result, by kind: the slowest rank's seconds of each block, and milliseconds per
    step of each phase (phases.phase_ms_per_step: the ranks' mean, the blocks' median)."""

    seconds: dict[str, list[float]]
    phase_ms: dict[str, dict[str, float]]


def run_side_by_side(jobs: Sequence[StepJob], kinds: Sequence[str], *, num_procs: int, threads_per_proc: int,
                     blocks: int, timeout_s: float, deadline_s: float) -> list[SideBySide]:
    """One start of `num_procs` workers (phalanx's launcher: its allocator setting, threads, the
    jobs' memory format) running `kinds` side by side for each job; per job, per kind, the
    slowest rank's seconds of each block and where a step's time went."""
    unknown = [kind for kind in kinds if kind not in SIDE_BY_SIDE_KINDS]
    if unknown or not kinds:
        raise ValueError(f"side-by-side kinds {list(kinds)}: choose from {', '.join(SIDE_BY_SIDE_KINDS)}")
    if num_procs == 1 and {"ddp", "lockstep", "lockstep-full"} & set(kinds):
        raise ValueError("ddp and lockstep contenders need at least 2 processes")
    jobs = tuple(jobs)
    if num_procs == 1:
        by_rank = run_fresh(_single, (jobs, tuple(kinds), blocks), num_procs=1, threads=threads_per_proc,
                            tune_allocator=True, deadline_s=deadline_s, name="side-by-side/1")
    else:
        spec = LaunchSpec(plan=parse_devices(f"cpu:{num_procs}", cuda_count=0), threads_per_device=threads_per_proc,
                          timeout_s=timeout_s, deadline_s=deadline_s)
        by_rank = launch(_worker, jobs, tuple(kinds), blocks, spec=spec)
    return [SideBySide({kind: [max(turns[i].seconds[kind][b] for turns in by_rank) for b in range(blocks)]
                        for kind in kinds},
                       {kind: phase_ms_per_step([turns[i].phases[kind] for turns in by_rank], job.steps)
                        for kind in kinds})
            for i, job in enumerate(jobs)]
