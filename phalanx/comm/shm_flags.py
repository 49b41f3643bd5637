"""The flag lines of an shm segment: how its ranks say "my part of round g is in place" and wait
for each other's (shm.py says what a round is; shm_kernel.c does the same compiled).

Each rank owns one 64-byte line of int64 words, written by it alone (no false sharing): ARRIVED
and REDUCED hold the last round it reached in each phase, MARK which flag word it sleeps on, and
TAGS, per buffer half, the tag code and key (`round_key`: round and size) of the last round
that wrote them (a small allreduce's, a reduce-scatter's or an all-gather's). Such a round
compares every rank's there once all arrived: for a call of one round, the collective board's
pairing check (watchdog.py), made on lines the flags' cache traffic brings anyway.

- Publish: one aligned 8-byte store after the data copies before it (x86-64 keeps stores in
  program order), then a futex wake for whoever sleeps on that word. Compiled, the store is a full
  fence and the wake-up syscall is made only when a peer's MARK names the word.
- Wait: spin `spin_s` (a running peer arrives within microseconds), then, for each late peer,
  mark, then sleep on its flag's futex, which returns at once if the word no longer holds the
  value seen. The kernel reads the word after a full fence of its own, so either it sees the new
  value or the publisher sees the mark (Dekker's pairing): no wake-up is lost. Sleeps last at most
  LIVENESS_EVERY_S; after each a peer gone is named as its board line says (finished: its exit
  may beat this look, and is no death; else its last step and the collective), the board is read
  (watchdog.py), and the timeout applies. `aborted` ends a wait at its next wake-up (teardown).
"""

from __future__ import annotations

import time
from typing import Callable

from phalanx.comm.shm_kernel import SMALL_AGREED, SMALL_LATE
from phalanx.comm.watchdog import CommError, check, gone_error
from phalanx.errors import PeerLost
from phalanx.runtime.board import Ticket
from phalanx.runtime.procs import process_alive
from phalanx.runtime.segment import Futex
from phalanx.runtime.world import World

LINE = 64  # bytes per rank's line
ARRIVED, REDUCED, MARK = 0, 1, 2  # int64 words of a line; MARK: 1 + the flag word slept on, 0 awake
TAGS = 3  # words TAGS + 2 * parity and + 1: the tag code and key of the last round in half parity that wrote them
SPIN_S = 50e-6  # busy-wait this long before sleeping (measured: a running peer arrives within it)
LIVENESS_EVERY_S = 0.5  # a futex sleep lasts at most this long: then check peers and the timeout


def round_key(g: int, size_bytes: int) -> int:
    """A round's key beside its tag code: the round number and the call's size in one int64 word,
    so a half's words left from round g - 2, or a peer's call of another size, never agree."""
    return ((g & 0x7FFFFFFF) << 32) | (size_bytes & 0xFFFFFFFF)


def call_tags(ticket: Ticket | None, g: int) -> tuple[int, int]:
    """What round `g` of the call `ticket` writes beside its flags: the tag code, and a key of the
    round and the call's size; without a ticket, a code of 0."""
    return (0, round_key(g, 0)) if ticket is None else (ticket.code, round_key(g, ticket.size_bytes))


class ShmError(CommError):
    """The segment could not be set up, or a peer died or timed out inside a collective."""


class ShmPeerGone(ShmError, PeerLost):
    """A peer died, or this rank is shutting down, inside a collective: an echo of another failure."""


class Flags:
    """The k flag lines at `address` (`words`: them as int64), and the members' pids (`pids`)."""

    def __init__(self, words: memoryview, address: int, pids: memoryview, *, world: World,
                 members: tuple[int, ...], rank: int, spin_s: float) -> None:
        self.words, self.address, self.pids = words, address, pids
        self.world, self.members, self.k, self.rank = world, members, len(members), rank
        self.spin_s, self.timeout_s = spin_s, world.timeout_s
        self.aborted = False
        self.compiled = None  # shm_kernel.Rounds, once bound: its publish and spin
        self._futex = Futex()

    def publish(self, field: int, value: int) -> None:
        if self.compiled is not None:
            self.compiled.publish(field, value)
            return
        index = self.rank * (LINE // 8) + field
        self.words[index] = value
        self._futex.wake(self.address + 8 * index)

    def write_tags(self, parity: int, code: int, key: int) -> None:
        """This rank's round in half `parity` carries `code` and `key` (before it publishes arrival)."""
        index = self.rank * (LINE // 8) + TAGS + 2 * parity
        self.words[index], self.words[index + 1] = code, key

    def tags_agree(self, parity: int, code: int, key: int) -> bool:
        """True when every rank's tag words of half `parity` hold `code` and `key` (once all arrived)."""
        if self.compiled is not None:
            return self.compiled.tags_agree(parity, code, key)
        stride, first = LINE // 8, TAGS + 2 * parity
        codes = self.words[first:first + self.k * stride:stride].tolist()
        keys = self.words[first + 1:first + 1 + self.k * stride:stride].tolist()
        return codes.count(code) == self.k and keys.count(key) == self.k

    def compiled_round_done(self, g: int, done: int, tags: tuple[int, int], ticket: Ticket | None,
                            rest: Callable[[], None]) -> bool:
        """What compiled round `g` returned (`done`: shm_kernel's SMALL_*): whether every rank's tag
        agreed. For a late peer (the spin ran out) it sleeps first, with the liveness checks; then
        `rest()` does the round's part after the wait (the sum, the copy out) and the tags are compared."""
        if done != SMALL_LATE:
            return done == SMALL_AGREED
        self.wait(ARRIVED, g, ticket, spun=True)
        rest()
        return self.tags_agree(g % 2, *tags)

    def wait(self, field: int, value: int, ticket: Ticket | None, *, spun: bool = False) -> None:
        """Return once every rank's `field` is >= value (the round); raise on death or timeout.
        `spun`: the caller has spun already (a compiled small round): go straight to sleep."""
        flags, stride = self.words, LINE // 8
        start = time.perf_counter()
        pending = [r for r in range(self.k) if r != self.rank]
        if not spun and self.compiled is not None:
            if self.compiled.spin(field, value):  # the spin, GIL released
                return
        elif not spun:
            spin_until = start + self.spin_s
            while True:
                pending = [r for r in pending if flags[r * stride + field] < value]
                if not pending or time.perf_counter() > spin_until:
                    break
        mark = self.rank * stride + MARK
        try:
            for r in pending:
                index = r * stride + field
                flags[mark] = index + 1  # before the futex reads the flag: a compiled publisher wakes marked peers
                while (seen := flags[index]) < value:
                    # Sleeps only while the flag still holds `seen`: a store in between returns at once.
                    self._futex.wait(self.address + 8 * index, seen, LIVENESS_EVERY_S)
                    if flags[index] < value:
                        self._check_peers(r, value, time.perf_counter() - start, ticket)
        finally:
            if pending:
                flags[mark] = 0

    def _check_peers(self, r: int, g: int, waited_s: float, ticket: Ticket | None) -> None:
        """Raise if pending peer `r` died, the call cannot complete (watchdog.check) or timed out
        (after a futex wake-up or its bounded sleep: cheap next to the sleep)."""
        pid, timeout_s = self.pids[r], self.timeout_s
        if not process_alive(pid):
            gone = gone_error(self.world, self.members[r], ticket)
            if gone is not None:
                raise gone
            raise ShmPeerGone(f"shm allreduce: rank {self.members[r]} (pid {pid}) died while rank "
                              f"{self.world.rank} waited for it in round {g}")
        if self.aborted:
            raise ShmPeerGone(f"shm allreduce abandoned in round {g}: this rank is shutting down")
        if ticket is not None:
            check(self.world, ticket, waited_s=waited_s, timeout_s=timeout_s, pending=[self.members[r]])
        elif waited_s > timeout_s:
            raise ShmError(f"shm allreduce: rank {self.members[r]} did not arrive within the {timeout_s:g} s timeout "
                           f"(round {g}); raise --timeout if a step can really take that long")
