"""Run a function on k local gloo processes and collect what each returns: the one way
distributed tests start workers, through the production launcher (`phalanx.runtime.launch.launch`), so
every distributed test also exercises it.

    results = run_workers(fn, world_size, *args, timeout_s=60)

spawns `world_size` fresh CPU processes (one thread each), which rendezvous on 127.0.0.1 at a
free port, each call `fn(world, *args)` and send back its return value; `results[rank]` is rank
`rank`'s value. `fn` must be a module-level function (spawn pickles it by name) and its result
picklable; tensors are fine. With `world_size == 1` the launcher runs `fn` in this process.

The test fails (`WorkersFailed`, an AssertionError) when any worker raises, dies, exits without
a result, or when the whole run exceeds `timeout_s` (a hung collective); every child is killed
in all cases, and the message starts with the failing rank, then every traceback collected. A
worker's `UsageError` is raised as is. The launcher tolerates gloo's exit-time SIGABRT after a
delivered result, with a warning (the baselines' "Traps").

On Linux the workers are forked from the launcher's fork server, which imported torch once for
the whole test session (runtime/fork_server.py): a run starts in well under a second after the
first. Spawned (elsewhere) each costs about 3 s (`import torch`), so batch many checks into one call.
"""

from __future__ import annotations

from typing import Any, Callable

from phalanx.runtime.devices import parse_devices
from phalanx.runtime.launch import LaunchSpec, WorkerFailed, launch

# Bounds every collective inside a worker; timeout_s bounds the whole run.
WORKER_COLLECTIVE_TIMEOUT_S = 30.0


class WorkersFailed(AssertionError):
    """A worker raised, hung, or died; the message holds what each rank reported."""


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60.0) -> list[Any]:
    """Run `fn(world, *args)` on `world_size` spawned CPU processes; return their results by rank."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    spec = LaunchSpec(plan=parse_devices(f"cpu:{world_size}", cuda_count=0), threads_per_device=1,
                      timeout_s=WORKER_COLLECTIVE_TIMEOUT_S, deadline_s=timeout_s)
    try:
        return launch(fn, *args, spec=spec)
    except WorkerFailed as exc:
        raise WorkersFailed(f"{fn.__qualname__} on {world_size} workers: {exc}") from None
