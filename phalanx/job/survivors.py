"""The survivors' save: when a worker of `phalanx train` dies, the ranks left save the step it reached.

A periodic checkpoint (`--checkpoint-every N`) bounds what a dead worker costs to N steps, trained
again after the restart. Data parallelism holds more than it needs to lose none: every surviving
replica is the whole model and optimizer at the last step (k devices compute the 1-device update),
and what a rank holds alone - its generators and its running sums of the epoch - is small. So each
rank posts, after every step, the step and its sums on the collective board (runtime/board.py:
shared memory, which outlives a dead rank), and every rank's RNG states are gathered once, as
training starts. When a collective then loses a peer (`worker_errors.is_echo`: it died or failed;
or `PeerStalled`: it stopped responding, frozen or starved, past `--timeout`), one survivor writes
that step's checkpoint by itself - the format and the two generations of every save, no collective
(`checkpoint.save_alone`) - and the restart (`--max-restarts`, torchrun's) or `--resume auto` goes
on from the step the run reached, where it went back to the last periodic checkpoint before. (The
idea is "just-in-time checkpointing", Gupta et al., EuroSys 2024; nothing here comes from it.)

It is made only where it is exact, else nothing is written and the periodic checkpoint stays the
newest:
- a replica's state: the data split, unsharded (a sharded run or a model split holds parts that only
  the dead rank had); CPU workers on one host (the board covers the world; reading the sums every
  step is free on a CPU and would make a GPU host wait for its device); BatchNorm synchronised (the
  default: every rank's running statistics are the same; each post keeps a copy of them, put back
  when a death inside the next step finds them moved by its forward);
- the writer's generators are where they were when training began (phalanx's models draw no
  random numbers while training), so the states gathered then are every rank's now;
- every rank, the dead one included, posted the writer's step (a rank that died between its step's
  exchange and its post leaves the others a step ahead of its sums), later than the newest checkpoint;
- the parameters are finite.
The writer is the lowest rank left (alive, and neither failed on its own nor stalled); one that
wrote marks its line, so a survivor that looks after it has exited does not write the same step again.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from phalanx.comm import PeerStalled, Tag, collective
from phalanx.runtime.board import FAILED
from phalanx.runtime.procs import process_alive
from phalanx.runtime.worker_errors import is_echo
from phalanx.runtime.world import World
from phalanx.train import checkpoint as ckpt
from phalanx.train.rng_state import rng_state

# Set while a job is armed: the survivors' save its failure handler makes (`saving`).
_ARMED: list[SurvivorsSave] = []
# The save this process made, for the line a torchrun worker ends with (cli.py): "PATH (epoch E, step S)".
_MADE: list[str] = []


@dataclass(kw_only=True)
class SurvivorsSave:
    """One rank's part: its posts, the run's start states, and how to write (job.py's `write`:
    (position, every rank's {rng, epoch_totals, loader}, note) -> path)."""

    world: World
    steps_per_epoch: int
    start_rng: list[dict]  # every rank's, gathered as training began
    location: str  # where the run's checkpoints are
    write: Callable[[ckpt.Position, list[dict], dict], object]
    module: nn.Module  # the replica's
    forwards: int = 0  # a BatchNorm model's training forwards so far (`keep_statistics`)
    forwards_at_post: int = 0  # ... and at the last post
    hook: object = None
    kept: list[torch.Tensor] | None = None  # the module's buffers as the last post found them

    def post(self, epoch: int, done: int, totals: list[float]) -> None:
        """After each step (`done` of the epoch's steps, 1-based): where this rank is, for its survivors."""
        self.world.board.post(epoch * self.steps_per_epoch + done, totals)
        if self.kept is not None:  # 4 us a step for lenet-bn's 9 buffers, 9 for resnet's 27 (2-core VM)
            torch._foreach_copy_(self.kept, list(self.module.buffers()))
            self.forwards_at_post = self.forwards

    def keep_statistics(self) -> None:
        """For a BatchNorm model: keep its buffers at each post, and count its training forwards; a
        forward since the last post (a death inside the next step) moved the running statistics, and
        the save puts the kept ones back."""
        def counted(module: nn.Module, _inputs) -> None:
            if module.training:
                self.forwards += 1

        self.kept = [buffer.detach().clone() for buffer in self.module.buffers()]
        self.hook = self.module.register_forward_pre_hook(counted)

    def after_peer_lost(self, stalled: int | None = None) -> str:
        """Write the checkpoint if this rank is the one to, and the conditions hold; says what it did.
        `stalled`: a rank that stopped responding (frozen, starved), lost though its process lives."""
        board, world = self.world.board, self.world
        posts = [board.posted(r) for r in range(world.world_size)]
        lines = board.lines()
        # The ranks left: a process that lives, and neither raised (its line says FAILED before its
        # peers learn it) nor stopped responding; a survivor marks FAILED only after this handler.
        alive = [r for r, line in enumerate(lines)
                 if line is not None and line.state != FAILED and process_alive(line.pid) and r != stalled]
        # The newest checkpoint on disk: the job's last save (or the one it resumed from), or one a
        # peer wrote just before it died.
        newest = ckpt.newest_state(self.location)
        saved_step = 0 if newest is None else int(newest["epoch"]) * self.steps_per_epoch + int(newest["step"])
        why = decide(rank=world.rank, posts=[p[0] if p else None for p in posts], alive=alive,
                     saved_step=saved_step, written=[board.written(r) for r in range(world.world_size)])
        if why is None and rng_changed(self.start_rng[world.rank], rng_state()):
            why = "the model drew random numbers while training: the dead rank's generators are not known"
        if why is None and self.forwards != self.forwards_at_post:  # the rank exits after the save: its to change
            torch._foreach_copy_(list(self.module.buffers()), self.kept)
        if why is None and not all(bool(torch.isfinite(p).all()) for p in self.module.parameters()):
            why = "the parameters are not finite"
        if why is not None:
            return why
        step = posts[world.rank][0]
        epoch = (step - 1) // self.steps_per_epoch  # posts follow a step: `done` runs 1..steps_per_epoch
        done = step - epoch * self.steps_per_epoch
        every = [{"rng": self.start_rng[r], "epoch_totals": posts[r][1], "loader": None}
                 for r in range(world.world_size)]
        lost = [r for r in range(world.world_size) if r not in alive]
        path = self.write(ckpt.Position(epoch=epoch, step=done, epoch_totals=tuple(posts[world.rank][1])), every,
                          {"lost_ranks": lost, "by_rank": world.rank, "saved_at": time.time()})
        board.mark_written(step)
        _MADE[:] = [f"{path} (epoch {epoch + 1}, step {done})"]
        return f"saved {_MADE[0]}"


def decide(*, rank: int, posts: list[int | None], alive: list[int], saved_step: int, written: list[int]) -> str | None:
    """Why this rank writes no survivors' save, or None when it is the one to write: `posts`, each
    rank's last posted global step (None: none); `alive`, the ranks left (their process lives, and
    they neither raised on their own nor stalled); `saved_step`, the newest checkpoint's on disk (0:
    none); `written`, the step each rank's line says it saved for the survivors (0: none)."""
    if min(alive, default=rank) != rank:
        return f"rank {min(alive)} is alive and writes it"
    step = posts[rank]
    if step is None:
        return "no step was trained yet"
    behind = [r for r, posted in enumerate(posts) if posted != step]
    if behind:
        return f"rank {behind[0]} posted step {posts[behind[0]]}, not {step}"
    if step <= saved_step:
        return f"the newest checkpoint already holds step {step}"
    if step in written:
        return f"rank {written.index(step)} saved step {step}"
    return None


def rng_changed(start: dict, now: dict) -> bool:
    """Whether a process's generators (train/rng_state.py's form) moved between `start` and `now`."""
    if start.keys() != now.keys() or not torch.equal(start["torch"], now["torch"]):
        return True
    if "cuda" in start and not torch.equal(start["cuda"], now["cuda"]):
        return True
    a, b = start["numpy"], now["numpy"]
    same_numpy = torch.equal(a["key"], b["key"]) and (a["pos"], a["has_gauss"]) == (b["pos"], b["has_gauss"])
    return not (same_numpy and start["python"] == now["python"])


def reason_not_armed(world: World, *, data_split: bool, sharded: bool, batchnorm: str | None,
                     location: str | None) -> str | None:
    """Why a run makes no survivors' save (the same on every rank: its settings and world), else None.
    `batchnorm`: None for a model without BatchNorm, else the replica's policy ("sync", "local")."""
    if location is None:
        return "nowhere to save"
    if not world.distributed or world.board is None or world.device.type != "cpu":
        return "not CPU workers of one host"
    if not data_split or sharded:
        return "no rank holds the whole state"
    if batchnorm == "local":
        return "BatchNorm's running statistics are each rank's own (--batchnorm local)"
    return None


def arm(world: World, *, steps_per_epoch: int, location: str, write, module: nn.Module, batchnorm: bool,
        why_not: str | None):
    """Every rank calls this as training starts (a collective where it arms: the RNG states are
    gathered): the rank's SurvivorsSave, or None where `why_not` (reason_not_armed's) says none is
    made; `batchnorm`: the module holds BatchNorm layers (its statistics are kept at each post)."""
    if why_not is not None:
        return None
    every: list = [None] * world.world_size
    with collective(world, Tag("RNG states")):
        dist.all_gather_object(every, rng_state())
    armed = SurvivorsSave(world=world, steps_per_epoch=steps_per_epoch, start_rng=every, location=location, write=write,
                          module=module)
    if batchnorm:
        armed.keep_statistics()
    _ARMED[:] = [armed]
    return armed


def made() -> str | None:
    """Where this process saved the run for the survivors ("PATH (epoch E, step S)"), if it did."""
    return _MADE[0] if _MADE else None


@contextlib.contextmanager
def saving() -> Iterator[None]:
    """Around a job: when it fails because a peer did, the armed survivors' save is made (or not)."""
    try:
        yield
    except Exception as exc:
        stalled = exc.culprit if isinstance(exc, PeerStalled) else None  # a frozen peer: named, alive
        if _ARMED and (is_echo(exc) or stalled is not None):
            # Said by the launcher when made (elastic.py reads the checkpoint); a save not made, or one
            # that failed (a full disk), leaves the periodic checkpoint, and the peer's death the report.
            with contextlib.suppress(Exception):
                _ARMED[0].after_peer_lost(stalled)
        raise
    finally:
        if _ARMED and _ARMED[0].hook is not None:
            _ARMED[0].hook.remove()
        _ARMED.clear()
