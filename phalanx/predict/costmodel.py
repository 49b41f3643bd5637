"""α–β cost models of the allreduce algorithms, and fitting α, β.

The Hockney model: sending one message of n bytes costs α + n/β. An allreduce of n bytes over k
ranks then costs L(k)·α + B(k)·n/β, where L counts the messages on the critical path and B the
bytes each rank must move, in units of n (Thakur, Rabenseifner & Gropp 2005, "Optimization of
Collective Communication Operations in MPICH", the allreduce section; the same coefficients
are in phalanx.comm's module docstrings):

| algorithm | L(k) | B(k) |
| --- | --- | --- |
| ring (reduce-scatter + all-gather) | 2(k-1) | 2(k-1)/k |
| tree (recursive doubling among p = 2^⌊log2 k⌋, a fold in and out for the k-p others) | log2 p (+2 if k>p) | the same |
| naive (the book's: gather to rank 0, add, send back; rank 0 serialises) | 2(k-1) | 2(k-1) |
| native (gloo / NCCL pick ring-based schedules for gradient-sized messages) | as ring | as ring |
| shm (copy in, each rank sums its chunk of every slot, copy out; waits on flags, not messages) | 2·log2 k | 3 + 1/k |
| hierarchical on H hosts (shm within each host, a ring between hosts): a host's link | 2(H-1) | 2(H-1)/H |

For shm, β is the memory bandwidth one rank's copies and adds reach, and B counts the bytes each
rank moves through memory per message byte (copy in, read k chunks of n/k, write n/k, copy out).
L counts its two flag waits per call; a wait ends when the last of k-1 peers arrives, which grows
with k about as log2 k (the 16-core host's MPI shared-memory allreduce: 7 µs at k=2, 18 µs at 8).

With nccl-tests' bus bandwidth (telemetry/bandwidth.py: busbw = algbw · 2(k-1)/k for an
allreduce, algbw = n / time), a ring's modelled busbw approaches β as n grows, whatever k.

Across H hosts (`hosts` > 1) β is one host's link and B counts the bytes a host sends on it: the
flat ring over k ranks numbered host by host (torchrun's numbering) crosses each host's link once
each way, so a host sends what one rank does, 2(k-1)/k of the message; the hierarchical one sends
2(H-1)/H (its shm steps run at memory bandwidth, a hundred times a Gbit link's, and overlap the
exchange window by window: comm/hierarchical.py). Its latency term is paid per window: a bucket
of n bytes goes between hosts as ceil(n / slot) gloo allreduces, each 2(H-1) messages. A host's
ranks share its link, so whatever m is, the link's rate bounds the exchange.
α and β are fitted per algorithm from a 2-rank sweep (`fit_link`): on gloo every call has a floor
of its own (~1 ms for a native call, ~0.1-0.3 ms per point-to-point message), so the α an
algorithm sees is its own, and the fit keeps predictions at k = 2 self-consistent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from phalanx.comm import ALGORITHMS
from phalanx.comm.shm import SLOT_BYTES
from phalanx.comm.tree import largest_power_of_two


def cost_terms(algorithm: str, world_size: int, *, hosts: int = 1) -> tuple[float, float]:
    """(L, B): an allreduce of n bytes costs L·α + B·n/β on `world_size` ranks (on `hosts` hosts:
    β is a host's link, B what a host sends on it)."""
    k = world_size
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown allreduce {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    if k < 1 or not 1 <= hosts <= k or k % hosts:
        raise ValueError(f"need world size >= 1 split evenly over 1..k hosts, got {k} ranks on {hosts} hosts")
    if k == 1:
        return 0.0, 0.0  # nothing to exchange
    if algorithm == "hierarchical":
        if hosts == 1:  # shm's reduce-scatter and all-gather
            return 2.0 * math.log2(k), 3.0 + 1.0 / k
        return 2.0 * (hosts - 1), 2.0 * (hosts - 1) / hosts
    if algorithm in ("ring", "native"):
        return 2.0 * (k - 1), 2.0 * (k - 1) / k
    if algorithm == "shm":
        return 2.0 * math.log2(k), 3.0 + 1.0 / k
    if algorithm == "tree":
        p = largest_power_of_two(k)
        steps = (p.bit_length() - 1) + (2 if k > p else 0)  # each step moves the whole buffer
        return float(steps), float(steps)
    return 2.0 * (k - 1), 2.0 * (k - 1)  # naive


def allreduce_time_s(algorithm: str, size_bytes: float, world_size: int, *, alpha_s: float, beta_Bps: float,
                     hosts: int = 1) -> float:
    """Predicted seconds for one allreduce of `size_bytes` (0 for an empty message or k = 1)."""
    if size_bytes < 0:
        raise ValueError(f"size must be >= 0 bytes, got {size_bytes}")
    if alpha_s < 0 or not beta_Bps > 0:
        raise ValueError(f"need alpha >= 0 and beta > 0, got alpha {alpha_s} s, beta {beta_Bps} B/s")
    latency, bandwidth = cost_terms(algorithm, world_size, hosts=hosts)
    if size_bytes == 0:
        return 0.0
    if algorithm == "hierarchical" and hosts > 1:
        latency *= math.ceil(size_bytes / SLOT_BYTES)  # one exchange between hosts per window
    return latency * alpha_s + bandwidth * size_bytes / beta_Bps


@dataclass(frozen=True, kw_only=True)
class LinkFit:
    alpha_s: float
    beta_Bps: float
    max_rel_error: float  # worst |model - measured| / measured over the fitted sizes


def fit_link(algorithm: str, sizes_bytes: Sequence[float], times_s: Sequence[float], *, world_size: int = 2) -> LinkFit:
    """Least-squares α, β so that L·α + B·n/β matches the measured times in *relative* error.

    Relative error weights small and large messages alike (an absolute fit would let the 16 MB
    point decide everything and miss the latency floor that small buckets pay). α is kept >= 0.
    """
    if len(sizes_bytes) != len(times_s) or len(sizes_bytes) < 2:
        raise ValueError(f"need at least two (size, time) pairs of equal count, got {len(sizes_bytes)}, {len(times_s)}")
    if min(times_s) <= 0 or len(set(sizes_bytes)) < 2:
        raise ValueError("times must be positive and sizes must differ")
    latency, bandwidth = cost_terms(algorithm, world_size)
    if latency == 0:
        raise ValueError("a world of size 1 has no link to fit")
    # Unknowns x = (α, γ = 1/β); each row a_i = (L, B·n_i) / t_i should give 1.
    rows = [(latency / t, bandwidth * n / t) for n, t in zip(sizes_bytes, times_s)]
    s11 = sum(a * a for a, _ in rows)
    s12 = sum(a * b for a, b in rows)
    s22 = sum(b * b for _, b in rows)
    r1 = sum(a for a, _ in rows)
    r2 = sum(b for _, b in rows)
    det = s11 * s22 - s12 * s12
    alpha, gamma = ((s22 * r1 - s12 * r2) / det, (s11 * r2 - s12 * r1) / det) if det > 0 else (-1.0, 0.0)
    if alpha < 0:  # no latency term fits: bandwidth only
        alpha, gamma = 0.0, r2 / s22
    if not gamma > 0:  # no bandwidth term fits (all sizes latency-bound): assume a very fast link
        alpha, gamma = r1 / s11, 1e-15
    beta = 1.0 / gamma
    worst = max(abs(allreduce_time_s(algorithm, n, world_size, alpha_s=alpha, beta_Bps=beta) - t) / t
                for n, t in zip(sizes_bytes, times_s))
    if not (math.isfinite(alpha) and math.isfinite(beta)):
        raise ValueError("the fit did not converge; the measured times are inconsistent")
    return LinkFit(alpha_s=alpha, beta_Bps=beta, max_rel_error=worst)
