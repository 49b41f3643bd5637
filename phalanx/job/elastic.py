"""Restarts that keep the exact trajectory: `phalanx train --max-restarts N [--elastic]`.

`train_with_restarts` runs the training job through `launch` and, when a worker fails (dies,
raises, stops answering), starts the whole worker set again from the last checkpoint, as
`torchrun --max-restarts` does, up to N times; each restart is one line on stderr naming the
rank and device that failed, how, the checkpoint and the device count. A resumed run continues
exactly (the checkpoint holds model, optimizer, RNG states, position and the epoch's sums), so a
restarted run ends bitwise equal to an uninterrupted one. The last checkpoint is most often the
survivors' save of the step the run reached (survivors.py): the line says so, and a run without
restarts ends with where it was saved and `--resume auto`.

`--elastic` goes on without a device that cannot be brought back. The rule: the worker on the
same device fails again in the attempt right after a restart, before the run got past the
checkpoint that attempt started from (its position is unchanged) - a device failing for good (a
GPU gone, a CPU worker that dies at every start), not two unrelated faults. The run then
continues from that checkpoint on the devices that remain. Giving a device up uses no restart:
it happens at most once per device (down to one), so the loop stays bounded. Because k devices
compute the 1-device update of the same global batch (loop.py), the run finished on fewer
devices ends where the uninterrupted one does, to rounding (float64: ~1e-15 relative).

Not restarted: bad input (`UsageError`), a checked condition ("run stopped: a NaN loss, replicas
that drifted" - a restart would repeat it), the launcher itself stopped by a signal. Under
torchrun, restarts and membership changes are torchrun's (its --max-restarts, --nnodes MIN:MAX);
each new worker set resumes by itself from the checkpoint (resume.py), on however many ranks.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from typing import Any, Callable, Sequence

from phalanx.runtime.devices import DevicePlan
from phalanx.errors import RunFailed, UsageError
from phalanx.runtime.launch import LaunchSpec, WorkerFailed, launch
from phalanx.runtime.restarts import failure_of
from phalanx.train import checkpoint as ckpt
from phalanx.job.config import TrainConfig
from phalanx.job.job import train_worker


def train_with_restarts(config: TrainConfig, names: Sequence[str], *, spec: LaunchSpec,
                        say: Callable[[str], None] | None = None) -> list[Any]:
    """`launch(train_worker, ...)` on `names`, restarted per config.restarts (--max-restarts, --elastic)
    (see the module docstring); returns the finished attempt's results by rank."""
    say = say or (lambda line: print(f"phalanx: {line}", file=sys.stderr, flush=True))
    if config.restarts.max_restarts == 0:
        started_at = time.time()
        try:
            return _launch_once(config, names, spec)
        except WorkerFailed as exc:  # the ranks left may have saved where the run stopped (survivors.py)
            saved = ckpt.newest_state(config.checkpoint_location)
            if _by_survivors(saved, since=started_at):
                where = _where(config.checkpoint_location, saved)
                raise WorkerFailed(f"{exc}\nthe run was saved where it stopped: {where}; run the same command with "
                                   "--resume auto to continue", rank=exc.rank,
                                   restartable=exc.restartable, traceback=exc.traceback) from None
            raise
    spec = replace(spec, spawn_single=True)  # one device too: a worker's death must leave the launcher
    plan, attempt, restarts = DevicePlan(names=tuple(names)), config, 0
    previous: tuple[str, tuple[int, int] | None] | None = None  # (device, checkpoint position) of the last failure
    while True:
        try:
            return _launch_once(attempt, plan.names, replace(spec, plan=plan))
        except WorkerFailed as exc:
            failure = failure_of(exc, plan.names)
            if failure is None:
                raise
            saved = ckpt.newest_state(config.checkpoint_location)
            position = None if saved is None else (int(saved["epoch"]), int(saved["step"]))
            where = _where(config.checkpoint_location, saved)
            failed = f"worker rank {failure.rank} ({failure.device}) {failure.what}"
            if config.restarts.elastic and previous == (failure.device, position) and _fits(config, plan.num_devices - 1):
                plan = DevicePlan(names=tuple(n for n in plan.names if n != failure.device))
                # The death alone: what a SIGKILL most likely was (runtime/oom.py) the restart line said.
                died = failure.what.split(": ", 1)[0] if failure.what.startswith("died (") else failure.what
                say(f"worker rank {failure.rank} ({failure.device}) {died} again before the run got past {where}: "
                    f"giving {failure.device} up (--elastic); "
                    f"going on from {where} on {plan.num_devices} device{'s' * (plan.num_devices > 1)} {plan}")
            elif restarts < config.restarts.max_restarts:
                restarts += 1
                say(f"{failed}; restart {restarts} of {config.restarts.max_restarts} from {where} "
                    f"on {plan.num_devices} device{'s' * (plan.num_devices > 1)} {plan}{failure.shown()}")
            else:
                raise
            previous = (failure.device, position)
            resume = config.checkpoint_location if position is not None else config.checkpoint.resume
            attempt = replace(config, checkpoint=replace(config.checkpoint, resume=resume), overwrite=False)  # overwrite happened once, before attempt 1


def _launch_once(config: TrainConfig, names: Sequence[str], spec: LaunchSpec) -> list[Any]:
    try:
        return launch(train_worker, config, tuple(names), spec=spec)
    except RunFailed as exc:  # one device runs in this process: report it as a spawned worker's is
        raise WorkerFailed(f"run stopped: {str(exc).splitlines()[0]}", rank=exc.culprit,
                           restartable=exc.restartable) from None


def _by_survivors(state: dict | None, *, since: float) -> bool:
    """Whether `state` is a survivors' save (survivors.py) made after `since` (a time.time())."""
    note = None if state is None else state.get("survivors")
    return isinstance(note, dict) and float(note.get("saved_at", 0.0)) >= since


def _where(location: str | None, state: dict | None) -> str:
    if state is None:
        return "the start (no checkpoint yet)"
    note = state.get("survivors") or {}
    lost = ", ".join(map(str, note.get("lost_ranks", [])))
    by = f", saved by rank {note.get('by_rank')} when rank {lost} was lost" if note else ""
    return f"{ckpt.checkpoint_path(location)} (epoch {int(state['epoch']) + 1}, step {int(state['step'])}{by})"


def _fits(config: TrainConfig, num_devices: int) -> bool:
    """Whether the run can go on with `num_devices` (at least one, each with a share of a batch)."""
    if num_devices < 1:
        return False
    try:
        config.check_devices(num_devices)
    except (ValueError, UsageError):
        return False
    return True
