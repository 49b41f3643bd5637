"""Where a contender's step goes: seconds per phase, summed on each rank while contenders take turns.

`phalanx bench scaling --side-by-side` says phalanx/k ran at 0.82 of its lockstep twin (k plain
processes meeting once a step through a 4-byte allreduce); it says why with this: each rank sums
its own forward (the loss included), backward, wait (phalanx's exchange in finish_gradient_sync;
the twin's meeting), optimizer step, and the rest of the block's time (zero_grad, the correct
count, the loop) over each block. A rank whose compute ran late waits least, so the phases are
averaged over the ranks: forward + backward is then how long the ranks computed, wait what the
exchange (or the meeting) cost on top, both in the block's own seconds.

`PhaseClock.span` is the one method of phalanx's Tracer that `train_batch` calls on this path,
so phalanx's step is timed by the same spans `phalanx train --trace` draws, and the plain step by
the same names around the same calls (job_steps.py). A span costs two perf_counter calls.
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

PHASES = ("forward", "backward", "wait", "optimizer")
OTHER = "other"  # the block's time outside every span


class _Span:
    """A reusable context for one phase: entering notes the time, leaving adds what passed."""

    __slots__ = ("clock", "name", "start_s")

    def __init__(self, clock: "PhaseClock", name: str) -> None:
        self.clock, self.name, self.start_s = clock, name, 0.0

    def __enter__(self) -> None:
        self.start_s = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.clock.seconds[self.name] += time.perf_counter() - self.start_s


class PhaseClock:
    """Seconds per phase (PHASES) on this rank since the last `take()`."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._spans = {name: _Span(self, name) for name in PHASES}

    def span(self, name: str) -> _Span:
        """`with clock.span("backward"):` adds the block's seconds to that phase."""
        if name not in self._spans:
            raise ValueError(f"phase {name!r} is not one of {', '.join(PHASES)}")
        return self._spans[name]

    def take(self) -> dict[str, float]:
        """The seconds per phase so far, the clock set back to zero."""
        taken, self.seconds = self.seconds, dict.fromkeys(PHASES, 0.0)
        return taken


def with_other(phases: dict[str, float], block_s: float) -> dict[str, float]:
    """A block's phases and, as OTHER, what of its `block_s` seconds no span covered."""
    return {**phases, OTHER: max(0.0, block_s - sum(phases.values()))}


def phase_ms_per_step(by_rank: Sequence[Sequence[dict[str, float]]], steps: int) -> dict[str, float]:
    """Milliseconds per step of each phase: `by_rank[r][b]` is rank r's seconds per phase in block
    b; averaged over the ranks within each block, then the median over the blocks."""
    blocks = len(by_rank[0])
    names = list(by_rank[0][0]) if blocks else []
    return {name: statistics.median(statistics.fmean(rank[b][name] for rank in by_rank) for b in range(blocks))
            * 1e3 / steps for name in names}
