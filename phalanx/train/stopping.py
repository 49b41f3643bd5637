"""Where a training loop stops when a scheduler asks (SIGTERM): after one step, the same on every
rank, saved there; `phalanx train`'s (job/step_hook.py) and a script's (`stop_requested`).

runtime/stop_request.py records the signal; the job asks the ranks at fixed steps whether any of
them got one. On one CPU host that is every step: one summed float over the replica's own
exchange, tens of microseconds through shared memory against steps of tens of milliseconds. On a
GPU it is every `--check-every` steps (100 by default), the steps that read the device anyway:
asking every step would make the host wait for the device each time; across hosts too, where
the question crosses the network. A run with nowhere to save (no `--out`,
no `--checkpoint-dir`) is not armed: SIGTERM ends it at once, as before. A script asks with
`phalanx.stop_requested(dp)` after each step, and saves (`phalanx.checkpoint`) when it says so.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from phalanx.comm import Tag, all_reduce_sum_
from phalanx.data_parallel.guards.finite import DEFAULT_CHECK_FINITE_EVERY
from phalanx.errors import PhalanxWarning, Stopped
from phalanx.runtime import stop_request
from phalanx.runtime.world import World

STOP_CHECK = Tag("stop check")


@dataclass(frozen=True)
class StopCheck:
    """When the ranks ask each other, how they sum, and where the run saves."""

    every_steps: int
    sum_over_ranks: Callable[[list[float]], list[float]] | None  # None: a world of one
    saved_in: str

    def agreed(self, global_step: int) -> bool:
        """At a due step (every rank calls this after every step): whether every rank stops now."""
        return global_step % self.every_steps == 0 and stop_request.agreed(self.sum_over_ranks)

    def stopped(self, where: str) -> Stopped:
        """After the save (which returns on every rank once the checkpoint is on disk)."""
        return stop_request.stopped_at(where, self.saved_in)


def stop_check(world: World, *, saved_in: str | None, check_every: int, replica=None) -> StopCheck | None:
    """The job's StopCheck, or None where there is nowhere to save. `replica`: a data split's
    DataParallel, whose exchange sums (a model split sums with the backend's allreduce)."""
    if saved_in is None:
        return None
    one_host = world.local_world_size == world.world_size
    every = 1 if world.device.type == "cpu" and one_host else (check_every or DEFAULT_CHECK_FINITE_EVERY)
    return StopCheck(every, _summing(world, replica), saved_in)


def _summing(world: World, replica) -> Callable[[list[float]], list[float]] | None:
    """`_sum_over_ranks` bound to `world` and `replica`; None in a world of one (nothing to ask)."""
    return functools.partial(_sum_over_ranks, world, replica) if world.distributed else None


def _sum_over_ranks(world: World, replica, values: list[float]) -> list[float]:
    """`values` summed over the ranks: through the replica's own exchange, else the backend's."""
    flat = torch.tensor(values, dtype=torch.float64, device=world.device)
    if replica is not None:
        replica.allreduce_now(flat, tag=STOP_CHECK)
    else:
        all_reduce_sum_(flat, world=world, tag=STOP_CHECK)
    return flat.tolist()


def stop_requested(dp) -> bool:
    """Whether a SIGTERM reached any rank: the same answer on every rank of replica `dp`'s world.

    A collective, for a script's own loop (under `phalanx run`, torchrun or a scheduler): every
    rank calls it at the same point, after each step (on a GPU every N steps: it reads the device).
    The first call arms this process: from then on its first SIGTERM no longer ends it at once but
    makes this return True on every rank after the same step; save (`phalanx.checkpoint`) and leave
    the loop, within the scheduler's grace period. A second SIGTERM ends the process as before.

        for step, (x, y) in enumerate(loader):
            ...
            if phalanx.stop_requested(dp):
                phalanx.checkpoint(path, world=world, model=dp, optimizer=opt, epoch=epoch, step=step + 1,
                                   global_batch_size=B, seed=SEED)
                break
    """
    if not isinstance(getattr(dp, "world", None), World):  # the World or the bare model: a replica's world is asked
        raise TypeError(f"stop_requested takes the replica, got {type(dp).__name__}: "
                        "phalanx.stop_requested(dp), dp being phalanx.prepare(model, world=world)")
    if not stop_request.arm():
        warnings.warn("phalanx.stop_requested: SIGTERM can be caught on the main thread only (phalanx.launch "
                      "runs a forked worker's function on another); here it still ends the process at once",
                      PhalanxWarning, stacklevel=2)
    return stop_request.agreed(_summing(dp.world, dp))
