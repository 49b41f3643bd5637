"""The point-to-point layer the hand-written allreduce algorithms run on.

An algorithm never calls `torch.distributed` directly: it describes each step as one
`exchange` (the messages it sends and the buffers it receives into), and a transport carries
them. `DistTransport` posts every send and receive of a step at once (`batch_isend_irecv`)
and waits for all of them, so a step in which two ranks send to each other cannot deadlock on
blocking sends (the classic pitfall of a ring written with `send` then `recv`). Keeping the
transport apart also lets unit tests run the same algorithm code in threads over an in-memory
mailbox, and lets a later async layer run it on a separate process group.

What it does not own: choosing peers or chunking (the algorithms do), and skipping empty
messages (callers must skip them on both sides, since a zero-byte message is not portable
across backends).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch
import torch.distributed as dist

# A message is (peer rank, tensor). Tensors must be contiguous; receive buffers are written.
Message = tuple[int, torch.Tensor]


# Called with a receive's index as soon as that receive (and every earlier one) has landed.
OnReceived = Callable[[int], None]


class Transport(Protocol):
    def exchange(
        self, *, sends: Sequence[Message] = (), recvs: Sequence[Message] = (), on_received: OnReceived | None = None
    ) -> None:
        """Post all sends and receives of one step concurrently; return when all completed.

        `on_received(i)` runs for each receive in order, as soon as receive i has landed, while
        later messages may still be in flight: the ring adds a segment as the next one arrives.
        """
        ...


@dataclass(frozen=True)
class DistTransport:
    """`torch.distributed` point-to-point ops on `group` (None: the default process group).

    Peer ranks are global ranks, as `dist.isend`/`dist.irecv` expect; a group created with
    `dist.new_group()` over all ranks has the same numbering. Waits are bounded by the process
    group's timeout (`World.timeout_s`), so a lost peer raises instead of hanging.
    """

    group: dist.ProcessGroup | None = None
    # The global rank of each peer number, for an algorithm that numbers the members of `group`
    # 0..n-1 (the hierarchical exchange: this rank's peers on the other hosts); None: peer
    # numbers are global ranks.
    ranks: tuple[int, ...] | None = None

    def exchange(
        self, *, sends: Sequence[Message] = (), recvs: Sequence[Message] = (), on_received: OnReceived | None = None
    ) -> None:
        at = (lambda peer: peer) if self.ranks is None else self.ranks.__getitem__
        # Receives first, so a buffer is already waiting when the matching send arrives.
        ops = [dist.P2POp(dist.irecv, buf, at(peer), group=self.group) for peer, buf in recvs]
        ops += [dist.P2POp(dist.isend, buf, at(peer), group=self.group) for peer, buf in sends]
        if not ops:
            return
        # batch_isend_irecv: on gloo a plain loop of isend/irecv; on NCCL one ncclGroup, without
        # which a pair of ranks that both post recv-then-send on one stream (a ring of two)
        # would deadlock.
        works = dist.batch_isend_irecv(ops)
        # Messages between one pair of ranks are matched in posting order (gloo: per pair and
        # tag; NCCL: per communicator), so receive i holds the peer's i-th send to this rank.
        if len(works) != len(ops):
            # NCCL coalesces the batch into one work: it is done as a whole (and on a stream).
            for work in works:
                work.wait()
            works = []
        for index in range(len(recvs)):
            if works:
                works[index].wait()
            if on_received is not None:
                on_received(index)
        for work in works[len(recvs):]:
            work.wait()
