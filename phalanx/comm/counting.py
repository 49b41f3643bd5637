"""A transport that counts what it carries: bytes and messages sent and received, and time blocked.

`CountingTransport` wraps any `Transport` (by default `DistTransport`) and adds up, per rank,
the payload bytes of every message it posts and receives and the wall time spent inside
`exchange` (waiting for a peer included). The model-parallel splits (pipeline, channels) send
everything through one, so `phalanx bench splits` reports bytes *counted on the wire* beside
each split's formula, and the time a device sat blocked in communication (its idle share).
`snapshot()` / `since()` give the counts of one step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

from phalanx.comm.transport import DistTransport, Message, OnReceived, Transport


@dataclass(frozen=True, kw_only=True)
class TrafficCounts:
    sent_bytes: int = 0
    received_bytes: int = 0
    messages_sent: int = 0
    blocked_s: float = 0.0

    def minus(self, earlier: "TrafficCounts") -> "TrafficCounts":
        return TrafficCounts(sent_bytes=self.sent_bytes - earlier.sent_bytes,
                             received_bytes=self.received_bytes - earlier.received_bytes,
                             messages_sent=self.messages_sent - earlier.messages_sent,
                             blocked_s=self.blocked_s - earlier.blocked_s)


@dataclass
class CountingTransport:
    """Counts every message of `inner`; `exchange` has the `Transport` contract."""

    inner: Transport = field(default_factory=DistTransport)
    sent_bytes: int = 0
    received_bytes: int = 0
    messages_sent: int = 0
    blocked_s: float = 0.0

    def exchange(self, *, sends: Sequence[Message] = (), recvs: Sequence[Message] = (),
                 on_received: OnReceived | None = None) -> None:
        for _, tensor in sends:
            if tensor.numel() == 0:  # a zero-byte message is not portable (transport.py)
                raise ValueError("CountingTransport: empty message; skip it on both sides instead")
            self.sent_bytes += tensor.numel() * tensor.element_size()
        self.messages_sent += len(sends)
        self.received_bytes += sum(t.numel() * t.element_size() for _, t in recvs)
        start = time.perf_counter()
        try:
            self.inner.exchange(sends=sends, recvs=recvs, on_received=on_received)
        finally:
            self.blocked_s += time.perf_counter() - start

    def snapshot(self) -> TrafficCounts:
        return TrafficCounts(sent_bytes=self.sent_bytes, received_bytes=self.received_bytes,
                             messages_sent=self.messages_sent, blocked_s=self.blocked_s)
