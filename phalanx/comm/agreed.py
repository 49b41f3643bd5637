"""What every rank agrees on: the small facts ranks compare before they trust each other, and
the outcome of work that may fail on some ranks alone.

`gather_objects(world, obj, tag)`: every rank's small picklable facts (flags, model shapes,
replica fingerprints), by rank, on every rank, which the guards compare.

`agreed_outcome(world, tag)`: work that may fail on some ranks alone (rank 0 writing a
checkpoint, each rank its share of one) ends in one small sum of the ranks that failed (and, where
one did, a `gather_objects` of what failed where), and every rank then raises that failure or none
does.

Without it a failure on rank 0 alone left the others in the checkpoint's next collective: a
script that goes on after a failed save (`except OSError:` around `phalanx.checkpoint`, for a
full disk) stopped at rank 0's next step with "ranks are in different collectives". Now every
rank raises the same error at the same call: caught, the ranks go on in step; uncaught, each
stops on the same line. Only this rank's own work goes inside the block, never a collective: a
collective's failure is the board's diagnosis already, and a second collective after it would
only hide it.
"""

from __future__ import annotations

import contextlib
import pickle
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from phalanx.comm.calls import collective, native
from phalanx.errors import PeerLost, UsageError, WriteFailed
from phalanx.runtime.tags import Tag
from phalanx.runtime.world import World


@contextlib.contextmanager
def agreed_outcome(world: World, tag: Tag, *, undo: Callable[[], None] | None = None) -> Iterator[None]:
    """Run the block on every rank, then agree: the rank whose block raised raises it again; every
    other rank raises the lowest failed rank's error rebuilt (`told_again`); if none failed, none
    raises. Where some rank failed, every rank first calls `undo()` (what its own part left on
    disk: a share no manifest will name). A stop (SIGTERM, Ctrl-C: BaseException) is not a
    failure to agree on; it passes."""
    failure = None
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - whatever this rank's own work raised, every rank hears it
        failure = exc
    mine = _telling(failure)
    # After the sum every rank is here: the gather waits for none.
    anywhere = world.distributed and _any_failed(world, tag, failure is not None)
    told = gather_objects(world, mine, tag) if anywhere else [mine]
    failed = [(rank, t) for rank, t in enumerate(told) if t is not None]
    if failed and undo is not None:
        undo()
    if failure is not None:
        raise failure
    if failed:
        raise told_again(*failed[0])


def gather_objects(world: World, obj: Any, tag: Tag) -> list[Any]:
    """Every rank's picklable `obj`, by rank, on every rank: one all_gather_object under
    `collective`, for the small facts ranks compare before trusting each other (flags, shapes,
    replica checks); `[obj]` in a world of one."""
    if not world.distributed:
        return [obj]
    gathered: list[Any] = [None] * world.world_size
    with collective(world, tag):
        dist.all_gather_object(gathered, obj)
    return gathered


def _any_failed(world: World, tag: Tag, failed_here: bool) -> bool:
    """Whether any rank failed: one small sum through `native`, whose wait is watched like every
    collective's (a rank still at its work past --timeout is named as such, at once), where a
    blocking all-gather of the failures would wait out the backend's own timeout first."""
    count = torch.tensor([int(failed_here)], dtype=torch.int32, device=world.device)
    native(world, tag, lambda: dist.all_reduce(count, async_op=True), size_bytes=4, dtype=count.dtype)
    return bool(count.item())


def _telling(failure: Exception | None) -> tuple | None:
    """What the other ranks need to raise `failure` again: its kind, errno and strerror, itself
    pickled (an OSError's: its own class, a WriteFailed, a ConnectionError, urllib's URLError),
    its type's name and its one line."""
    if failure is None:
        return None
    kind = "usage" if isinstance(failure, UsageError) else "os" if isinstance(failure, OSError) else "other"
    pickled = None
    if kind == "os":
        with contextlib.suppress(Exception):  # an exception that does not pickle is rebuilt as an OSError
            pickled = pickle.dumps(failure)
    return kind, getattr(failure, "errno", None), getattr(failure, "strerror", None), pickled, \
        type(failure).__name__, str(failure)


def told_again(rank: int, told: tuple) -> Exception:
    """Rank `rank`'s failure as this rank raises it, with the same line, so a run that stops names
    it once whichever rank reports it: bad input stays a UsageError (exit 2); an OSError keeps its
    class, errno and strerror (a full disk's WriteFailed, a failed download's ConnectionError: the
    script's `except OSError:` catches it on every rank), a plain OSError with its line where it
    does not unpickle; anything else (a bug) is a PeerLost naming the rank and the error's type:
    the echo of the failed rank's own report, whose traceback the launcher shows."""
    kind, errno, strerror, pickled, name, line = told
    if kind == "usage":
        return UsageError(line)
    if kind == "os":
        try:
            failed = pickle.loads(pickled)
        except Exception:  # noqa: BLE001 - not pickled, or its class cannot be rebuilt here
            failed = None
        if not isinstance(failed, OSError) or str(failed) != line:
            return OSError(line)
        if isinstance(failed, WriteFailed) and failed.errno is None:  # set after construction: not pickled
            failed.errno, failed.strerror = errno, strerror
        return failed
    return PeerLost(f"rank {rank} failed: {name}: {line}")
