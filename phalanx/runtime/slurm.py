"""A process that is one of several tasks of a Slurm step without a launcher's world: refused in one line.

`srun --ntasks 2 python train.py` (or `srun --ntasks 2 phalanx bench ...`) starts two processes
with no RANK/WORLD_SIZE; each would make a world of one, or start its own workers, beside the
other, and both write the same outputs. torchrun's rendezvous is how several tasks form one world.
"""

from __future__ import annotations

import os
from typing import Mapping

from phalanx.errors import UsageError

# Set to 1 when the tasks of a Slurm step are meant to run alone, each its own world of one (a
# sweep that picks its settings from SLURM_PROCID): `alone_in_slurm_step` then lets them.
INDEPENDENT_TASKS_VAR = "PHALANX_INDEPENDENT_TASKS"


def alone_in_slurm_step(environ: Mapping[str, str] | None = None, *, command: str | None = None) -> None:
    """Refuse, in one line, a process that would make a world of one (no RANK/WORLD_SIZE, no group
    of its own) while it is one of several tasks of a Slurm step: `srun --ntasks 2 python train.py`
    starts two such processes, each rank 0 of 1, training alone and writing the same outputs.

    srun exports SLURM_STEP_NUM_TASKS (its step's tasks) and SLURM_PROCID (this task's index). A
    batch script is one process however many tasks the job holds (its SLURM_NTASKS counts the
    job's), so where SLURM_JOB_ID shows a real job and srun did not start this step, it passes.
    torch.distributed reads no SLURM variable; Lightning forms its world from SLURM_PROCID and
    SLURM_NTASKS, which needs an address every task agrees on - torchrun's rendezvous gives one.
    `command`: a command that starts its own workers (bench, verify, predict, sweep), whose tasks
    would each run it beside the others, timing one another on the same cores. A process a launcher
    started (RANK and WORLD_SIZE set, as launcher_env reads them) passes: its world is the launcher's."""
    env = os.environ if environ is None else environ
    if "SLURM_PROCID" not in env or env.get(INDEPENDENT_TASKS_VAR) == "1" or ("RANK" in env and "WORLD_SIZE" in env):
        return
    if "SLURM_STEP_NUM_TASKS" in env:
        tasks_text = env["SLURM_STEP_NUM_TASKS"]
    elif "SLURM_JOB_ID" in env:  # a batch script (or salloc's shell): one process, whatever SLURM_NTASKS says
        return
    else:
        tasks_text = env.get("SLURM_NTASKS", "1")
    try:
        tasks = int(tasks_text)
    except ValueError:
        return  # not a count: nothing to say about it
    if tasks > 1 and command is not None:
        raise UsageError(
            f"this process is Slurm task {env['SLURM_PROCID']} of {tasks}, so each task would run phalanx {command} "
            f"beside the others (each starting its own workers on the same cores, timing one another, writing the "
            f"same outputs); run it as one task (srun --ntasks 1 phalanx {command} ...), or set "
            f"{INDEPENDENT_TASKS_VAR}=1 if each task is meant to run alone")
    if tasks > 1:
        raise UsageError(
            f"this process is Slurm task {env['SLURM_PROCID']} of {tasks} but has no RANK/WORLD_SIZE, so each task "
            f"would train alone as rank 0 of 1 and write the same outputs; start one launcher per host "
            f"(srun --ntasks-per-node 1 torchrun --nnodes $SLURM_NNODES --nproc-per-node K --rdzv-backend c10d "
            f"--rdzv-endpoint HOST:PORT script.py, or phalanx run --devices cpu:K on one host), or set "
            f"{INDEPENDENT_TASKS_VAR}=1 if each task is meant to run alone")
