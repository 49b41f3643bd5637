"""Whether `phalanx.init()` runs in a worker or in a process that a worker started.

`init()` makes a world of one, said in one warning, in two kinds of child process that would
otherwise go wrong without a word or with the whole run:

- A child with neither a launcher's variables nor a process group (torch.multiprocessing.spawn's,
  as torch's DDP tutorial starts them): it trains alone (`ALONE_IN_A_CHILD`).
- A process that inherited a worker's launcher variables after that worker had joined the run
  (rank 0 running an evaluation script with `subprocess.run`): it tried to join as a second rank
  R, waited out the timeout in the store, and rank 0, waiting for it, took the run down with a
  line blaming rank 0's own work (found by an outside-user trial, 2026-12-06). A worker stamps its
  pid and the run it joined (store address and rank: `run_key`) into its environment as it joins
  (`stamp_joined`); a process whose variables name the same run and rank under another pid's stamp
  is a descendant of that worker (`joined_worker`). A process started before any join - a wrapper
  script that runs the real training with subprocess - carries no stamp, and joins as the worker,
  as it does under torchrun; so do the workers of a launcher a worker starts (torchrun, for a
  sweep's trial), whose variables name another run, and phalanx's own launcher gives its workers
  an empty stamp whatever its own environment holds (launch.torchrun_env).
"""

from __future__ import annotations

import os

JOINED_PID = "PHALANX_JOINED_PID"  # "pid@run_key" of the worker that joined the run with these variables

# torch's DDP tutorial starts its workers with torch.multiprocessing.spawn; with neither a launcher's
# variables nor a group the script opened, each child would train alone, silently.
ALONE_IN_A_CHILD = ("phalanx.init() in a child process found no RANK/WORLD_SIZE and no process group, so this "
                    "process is a world of one and trains alone; start the script with `phalanx run --devices cpu:K "
                    "script.py` (or torchrun) instead of torch.multiprocessing.spawn, or call "
                    "torch.distributed.init_process_group(...) before phalanx.init()")


def run_key(env) -> str:
    """Which run and rank a launcher's variables (a world.LauncherEnv) name: its store and the rank."""
    return f"{env.master_addr}:{env.master_port}/{env.rank}"


def stamp_joined(key: str) -> None:
    """Mark this process as the worker that joined run `key`: the processes it starts inherit the mark."""
    os.environ[JOINED_PID] = f"{os.getpid()}@{key}"


def joined_worker(key: str) -> int | None:
    """The pid of the worker that joined run `key` and whose variables this process inherited; None
    when this process is that worker, no worker had joined when it was started, or the stamp is of
    another run (a launcher between them set new variables)."""
    pid, _, stamped_key = os.environ.get(JOINED_PID, "").partition("@")
    return int(pid) if pid.isdigit() and int(pid) != os.getpid() and stamped_key == key else None


def inherited_message(rank: int, worker_pid: int) -> str:
    """The warning of a world of one made in a descendant of worker `rank`."""
    return (f"phalanx.init() in pid {os.getpid()}, a process that worker rank {rank} (pid {worker_pid}) started after "
            f"it joined the run, found that worker's RANK and WORLD_SIZE in its environment: it cannot join the run as "
            f"a second rank {rank}, so this process is a world of one (one device, no collectives); to have the job's "
            f"ranks run this code, call it from the workers themselves, or start this process without RANK and "
            f"WORLD_SIZE in its environment to silence this")
