"""The join of a torchrun job's workers: every rank checks in at the store before the process
group opens, and a rank whose node refused its command line says so there.

Each node of a torchrun job checks its own flags and paths before its workers join (an `--out`
it cannot create, say). Before this module the refused node's worker exited with its one line,
and every other node's workers waited inside gloo's rendezvous for the whole `--timeout`
(120 s), then printed a Python traceback ending in `DistStoreError: wait timeout after 30000ms,
keys: /phalanx/none/0//0//cpu//0/1` (an outside-user trial, 2 nodes x 1 worker): nothing named
the node or the reason. Now the refusing worker leaves its line in the store (`post_refusal`,
from the CLI's error path) and the waiting ranks poll for it (`wait_for_peers`, every 50 ms: a
store round trip or two each), so every node ends within a poll with the refused node's own line;
a rank that never checks in is named, with its node, when `--timeout` runs out.
"""

from __future__ import annotations

import datetime
import os
import time

import torch.distributed as dist

from phalanx.errors import RunFailed, UsageError

POLL_S = 0.05
REFUSED = "refused"


class JoinTimedOut(RunFailed):
    """Some ranks never checked in at the store within the timeout."""


class PeerRefused(UsageError):
    """Another rank's node refused its command line before joining (its line, relayed)."""


_checked_in = False  # this process reached the join: a refusal after it is every rank's own, not relayed


def attempt_prefix() -> str:
    """The store prefix of this attempt of the job (one per torchrun restart, see world.py)."""
    return f"phalanx/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def wait_for_peers(store, *, rank: int, world_size: int, node_rank: int, timeout_s: float) -> None:
    """Check in as `rank` and wait until every rank has; UsageError with another rank's refusal
    as soon as one is posted, JoinTimedOut naming the ranks still missing after `timeout_s`."""
    global _checked_in
    _checked_in = True
    try:
        _wait(store, rank=rank, world_size=world_size, node_rank=node_rank, timeout_s=timeout_s)
    except dist.DistError as exc:  # the store's host (torchrun's agent on the first node) went away
        raise JoinTimedOut(f"rank {rank} (node {node_rank}) lost the job's store while waiting for the other ranks "
                           f"to join ({str(exc).splitlines()[0]}): the first node's torchrun agent stopped, or the "
                           "link to it failed") from None


def _wait(store, *, rank: int, world_size: int, node_rank: int, timeout_s: float) -> None:
    store.set(f"joined/{rank}", str(node_rank))
    everyone = [f"joined/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    while True:
        if store.check([REFUSED]):
            raise PeerRefused(store.get(REFUSED).decode(errors="replace"))
        if store.check(everyone):
            return
        if time.monotonic() > deadline:
            missing = [r for r in range(world_size) if not store.check([f"joined/{r}"])]
            ranks = f"rank{'s' * (len(missing) > 1)} {', '.join(map(str, missing))}"
            raise JoinTimedOut(f"rank {rank} (node {node_rank}) waited {timeout_s:g} s (--timeout) for {ranks} to join "
                               f"the job: {'their' if len(missing) > 1 else 'its'} worker stopped before joining (that "
                               "node's own output says why) or cannot reach this job's store; torchrun's agent ends "
                               "this node's workers")
        time.sleep(POLL_S)


def post_refusal(message: str) -> None:
    """Under torchrun, across ranks: leave `message` (this rank's own error, before it joined)
    in the job's store, named by rank and node, for the ranks waiting in `wait_for_peers`. Best
    effort, bounded by 5 s: a store that cannot be reached leaves them their --timeout."""
    env = os.environ
    if _checked_in or "TORCHELASTIC_RUN_ID" not in env or not env.get("WORLD_SIZE", "1").isdigit() \
            or int(env["WORLD_SIZE"]) < 2:
        return
    try:
        store = dist.TCPStore(env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29500")),
                              is_master=False, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)
        dist.PrefixStore(attempt_prefix(), store).set(
            REFUSED, f"rank {env.get('RANK', '?')} (node {env.get('GROUP_RANK', '?')}) refused its command line: "
                     f"{message}; fix it there and start every node again")
    except Exception:  # noqa: BLE001 - the rank's own line is already out; the others keep their timeout
        pass
