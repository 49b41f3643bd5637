"""From a one-device profile and a link model to the step time on k devices: the arithmetic only.

What a k-device step costs (phalanx's overlap, data_parallel/overlap.py): every rank computes forward
and backward on its shard; bucket i's allreduce is launched once its last gradient has landed
*and* bucket i-1 has launched, and the buckets' allreduces run one after another on one channel
(the backend pairs the i-th collective of every rank). So with r_i the time bucket i becomes
ready after backward starts and c_i its allreduce time, bucket i runs over
[s_i, e_i] with s_i = max(r_i, e_{i-1}), e_i = s_i + c_i. Whatever runs before backward ends
(time b) is *hidden*; the rest, max(0, e_last - b), is *exposed*: the wait in
finish_gradient_sync. Hidden communication is free only when something other than the compute
cores moves the bytes; with η the measured share that really hides, the step is

    step = compute_k + exposed + (1 - η) · hidden

A replica that does not overlap (overlap auto where the workers' threads fill the cores, or
--no-overlap) exchanges its one flat bucket after backward: r = b, nothing hides, all is exposed.

Lockstep: every collective waits for the slowest rank, so compute_k is the expected maximum of
k draws of the one-device step time, E[max_k] = Σ_i x_(i) [(i/n)^k - ((i-1)/n)^k] over the n
sorted samples (the order statistic of the empirical distribution); backward and the ready
times stretch with it. Devices that share a host's C cores are time-sliced once their k·t
threads exceed the cores: a fair scheduler gives each of N runnable threads min(1, C/N) of a
core, counting other programs' threads too (estimated from the busy cores they left while the
profile ran), so compute stretches by max(1, N_k/C) / max(1, N_profile/C); the link's α, measured
with processes that fit, stretches by k·t/C once they do not.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

from phalanx.predict.costmodel import allreduce_time_s


@dataclass(frozen=True, kw_only=True)
class Overlap:
    comm_s: float  # all buckets' allreduce time
    hidden_s: float  # of it, the part that ran while backward was still computing
    exposed_s: float  # the part after backward: the wait before the optimizer
    schedule_s: tuple[tuple[float, float], ...]  # (start, end) per bucket, since backward started


def schedule_buckets(ready_s: Sequence[float], comm_s: Sequence[float]) -> list[tuple[float, float]]:
    """(start, end) of each bucket's allreduce on one in-order channel."""
    if len(ready_s) != len(comm_s):
        raise ValueError(f"{len(ready_s)} ready times for {len(comm_s)} buckets")
    if any(t < 0 for t in list(ready_s) + list(comm_s)):
        raise ValueError("ready times and allreduce times must be >= 0")
    spans, end = [], 0.0
    for ready, duration in zip(ready_s, comm_s):
        start = max(ready, end)
        end = start + duration
        spans.append((start, end))
    return spans


def overlap(ready_s: Sequence[float], comm_s: Sequence[float], backward_s: float) -> Overlap:
    """Split the buckets' allreduce time into what hides behind backward and what is exposed."""
    if backward_s < 0:
        raise ValueError(f"backward time must be >= 0, got {backward_s}")
    spans = schedule_buckets(ready_s, comm_s)
    hidden = sum(max(0.0, min(end, backward_s) - start) for start, end in spans)
    exposed = max(0.0, spans[-1][1] - backward_s) if spans else 0.0
    return Overlap(comm_s=float(sum(comm_s)), hidden_s=hidden, exposed_s=exposed, schedule_s=tuple(spans))


def expected_max(samples: Sequence[float], k: int) -> float:
    """E[max of k independent draws] from the empirical distribution of `samples`."""
    if not samples:
        raise ValueError("need at least one sample")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    ordered = sorted(samples)
    n = len(ordered)
    return sum(x * ((i / n) ** k - ((i - 1) / n) ** k) for i, x in enumerate(ordered, start=1))


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """One device's measured step at one (per-device batch, threads, co-runners) setting; medians."""

    batch_size_per_device: int
    threads: int
    co_runners: int  # processes that ran this step at the same time on the host (1: alone)
    forward_s: float
    backward_s: float
    optimizer_s: float
    other_s: float  # zero_grad, the (local) gradient sync call, bookkeeping
    step_samples_s: tuple[float, ...]  # whole compute steps, every co-runner's pooled
    bucket_ready_s: tuple[float, ...]  # bucket i's last gradient landed, since backward started
    bucket_bytes: tuple[int, ...]
    others_busy_cores: float = 0.0  # cores other programs kept busy while this was measured
    overlapped: bool = True  # buckets go out beside backward; False: one exchange after it

    def __post_init__(self) -> None:
        if len(self.bucket_ready_s) != len(self.bucket_bytes):
            raise ValueError(f"{len(self.bucket_ready_s)} ready times for {len(self.bucket_bytes)} buckets")
        if not self.step_samples_s or min(self.step_samples_s) <= 0:
            raise ValueError("a profile needs positive step samples")

    @property
    def step_s(self) -> float:
        return statistics.median(self.step_samples_s)


@dataclass(frozen=True, kw_only=True)
class StepPrediction:
    world_size: int
    global_batch_size: int
    compute_s: float  # the slowest of k ranks' forward + backward + optimizer
    comm_s: float
    hidden_s: float
    exposed_s: float
    overlap_penalty_s: float  # (1 - η) · hidden: hidden communication's cost to the compute cores
    step_s: float
    timeslice: float  # compute stretch against the profile (time-slicing, the host's other load)

    @property
    def images_per_s(self) -> float:
        return self.global_batch_size / self.step_s

    @property
    def hidden_fraction(self) -> float:
        """Share of communication time that really hid (η · hidden / all); 1 when nothing to send."""
        if self.comm_s == 0:
            return 1.0
        return max(0.0, (self.comm_s - self.exposed_s - self.overlap_penalty_s) / self.comm_s)  # not -0% from rounding


def predict_step(profile: DeviceProfile, *, world_size: int, global_batch_size: int, algorithm: str,
                 alpha_s: float, beta_Bps: float, overlap_efficiency: float, timeslice: float = 1.0,
                 comm_stretch: float = 1.0, hosts: int = 1) -> StepPrediction:
    """The predicted lockstep step on `world_size` devices from one device's profile.

    `comm_stretch` multiplies α, the per-message latency: k processes time-sliced on too few
    cores answer each message only when scheduled (`oversubscription`). `hosts`: the devices
    are spread over that many hosts, and α, β are a host's link (costmodel.cost_terms)."""
    if not 0.0 <= overlap_efficiency <= 1.0:
        raise ValueError(f"overlap efficiency must be in [0, 1], got {overlap_efficiency}")
    if not timeslice > 0 or comm_stretch < 1.0:
        raise ValueError(f"need timeslice > 0 and comm_stretch >= 1, got {timeslice}, {comm_stretch}")
    samples = [s * timeslice for s in profile.step_samples_s]
    compute = expected_max(samples, world_size)
    stretch = compute / statistics.median(samples) * timeslice  # one device's times -> the slowest rank's
    backward = profile.backward_s * stretch
    # Without overlap nothing goes out before backward ends: every bucket is exposed.
    ready = [min(r * stretch, backward) if profile.overlapped else backward for r in profile.bucket_ready_s]
    comm = [allreduce_time_s(algorithm, n, world_size, alpha_s=alpha_s * comm_stretch, beta_Bps=beta_Bps, hosts=hosts)
            for n in profile.bucket_bytes]
    split = overlap(ready, comm, backward)
    penalty = (1.0 - overlap_efficiency) * split.hidden_s
    return StepPrediction(world_size=world_size, global_batch_size=global_batch_size, compute_s=compute,
                          comm_s=split.comm_s, hidden_s=split.hidden_s, exposed_s=split.exposed_s,
                          overlap_penalty_s=penalty, step_s=compute + split.exposed_s + penalty, timeslice=timeslice)


def oversubscription(world_size: int, threads_per_device: int, cores: int, *, shares_host: bool) -> float:
    """k·t / C when k workers of t threads overfill a host's C cores, else 1. The link is measured
    with 2 one-thread processes, which fit; beyond the cores every message waits for its
    receiver to be scheduled, so α grows by this factor. (On this 2-core machine, predict
    --validate: without it LeNet at k = 4 was over-predicted by 6-16%; stretching β as well
    under-predicted the bandwidth-bound MLP at k = 4 by 15-20%.)"""
    if not shares_host:
        return 1.0
    return max(1.0, world_size * threads_per_device / cores)


def others_threads(others_busy_cores: float, our_threads: int, cores: int) -> float:
    """Runnable threads of other programs that would keep `others_busy_cores` busy beside ours.

    Under a fair scheduler N runnable threads on C cores each get min(1, C/N) of a core. If
    ours (t threads) and theirs (L) fit, they used L cores; otherwise L·C/(t+L) = u, so
    L = u·t/(C-u)."""
    u = min(max(0.0, others_busy_cores), cores - 1e-3)
    return u if our_threads + u <= cores else u * our_threads / (cores - u)


def timeslice_factor(world_size: int, threads_per_device: int, cores: int, *, shares_host: bool,
                     co_runners: int = 1, others_busy_cores: float = 0.0,
                     target_others_busy_cores: float | None = None) -> float:
    """How much slower each device computes at k than it did in its profile (1 when they fit).

    The profile ran `co_runners` copies of t threads beside other programs that kept
    `others_busy_cores` busy; at k it is k copies, beside the same other programs (or beside
    ones that keep `target_others_busy_cores` busy: how a measurement's own load is met). Each
    thread's share of a core is min(1, C/N) with N runnable threads, so the step stretches by
    max(1, N_k/C) / max(1, N_profile/C) - with an idle host simply k·t/C once k·t exceeds C.
    This fits one-thread workers; a multi-threaded one on a busy host loses more (its threads
    wait for each other at every parallel region, and the scheduler does not run them together)."""
    if min(world_size, threads_per_device, cores, co_runners) < 1:
        raise ValueError(f"need k, threads, cores, co-runners >= 1, got {world_size}, {threads_per_device}, "
                         f"{cores}, {co_runners}")
    if not shares_host:
        return 1.0
    ours, theirs = co_runners * threads_per_device, world_size * threads_per_device
    others = others_threads(others_busy_cores, ours, cores)
    target = others if target_others_busy_cores is None else others_threads(target_others_busy_cores, theirs, cores)
    return max(1.0, (theirs + target) / cores) / max(1.0, (ours + others) / cores)
