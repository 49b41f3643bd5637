"""The timing method for collectives, run on every rank of a world: `bench allreduce`'s and the link
measurement's of `phalanx predict`.

Per call (a size and an algorithm, say): warm-up calls first (connections, buffers, caches), a
barrier, then one call timed alone to calibrate how many calls make a timed batch of about
`target_batch_s` (timing.calls_for). Every rank must issue the same number of collectives or
they would mismatch, so the ranks agree on the largest count (one allreduce MAX). Then, round by
round and interleaved, each call's batch starts at a barrier - no rank's time includes a peer's
lag - and its seconds per call are one sample. A collective is done when its last rank is:
`slowest_per_round` (timing.py) turns every rank's samples into the ones to report.
"""

from __future__ import annotations

from typing import Callable, Hashable, Mapping

import torch
import torch.distributed as dist

from phalanx.measure.timing import MAX_CALLS, TARGET_BATCH_S, calls_for, run_interleaved, seconds_per_call


def time_collectives(calls: Mapping[Hashable, Callable[[], object]], *, rounds: int, warmup_calls: int = 2,
                     target_batch_s: float = TARGET_BATCH_S, max_calls: int = MAX_CALLS) -> dict:
    """This rank's samples: {"calls": {key: calls per batch}, "samples": {key: [seconds per call, one
    per round]}}. Call it at the same point on every rank, with the same keys in the same order."""
    if warmup_calls < 0:
        raise ValueError(f"warmup_calls must be >= 0, got {warmup_calls}")
    keys = list(calls)
    estimates = []
    for key in keys:
        for _ in range(warmup_calls):
            calls[key]()
        dist.barrier()
        estimates.append(seconds_per_call(calls[key], 1))
    counts = torch.tensor([calls_for(s, target_batch_s=target_batch_s, max_calls=max_calls) for s in estimates],
                          dtype=torch.int64)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)  # every rank issues as many collectives
    agreed = dict(zip(keys, counts.tolist()))

    def batch(key: Hashable) -> Callable[[], float]:
        def run() -> float:
            dist.barrier()  # start every batch together, so no rank's time includes a peer's lag
            return seconds_per_call(calls[key], agreed[key])
        return run

    samples = run_interleaved({key: batch(key) for key in keys}, rounds=rounds, warmup_rounds=0)
    return {"calls": agreed, "samples": samples}
