"""What `phalanx predict` is asked: the run to plan (`PredictConfig`) and the link between devices
(`Interconnect`, with presets for planning).

A link is three numbers: α, the fixed cost of one message (s); β, the bandwidth one message
stream reaches (bytes/s); and η, the share of communication time that really hides behind
computation when it runs during backward (1: dedicated hardware moves the bytes - a GPU's copy
engines, an RDMA NIC; on this CPU host gloo's threads copy through the kernel on the same cores
that compute, so η is measured). `loopback` is measured on this machine (k worker processes on
its cores, gloo over 127.0.0.1). The other presets are planning figures for k devices like this
one linked by that interconnect, from published nccl-tests-style bus bandwidths, rounded down:
PCIe 4.0 x16 peer-to-peer ~20 GB/s, NVLink 3 (A100) ~230 GB/s busbw (150 assumed), 25 and 100
GbE at ~90% of line rate; α from typical small-message latencies (NCCL on NVLink/PCIe a few µs,
kernel TCP ~25 µs). `--alpha-us`, `--beta-gbps` and `--overlap-efficiency` replace any of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from phalanx.measure.mlp import BENCH_MODELS
from phalanx.comm import check_choice
from phalanx.comm.shm import shm_supported
from phalanx.data_parallel import DEFAULT_BUCKET_CAP_MB


@dataclass(frozen=True, kw_only=True)
class Interconnect:
    name: str
    alpha_s: float | None  # None: measured on this machine
    beta_Bps: float | None  # bytes per second; None: measured
    overlap_efficiency: float | None  # η in [0, 1]; None: measured
    shares_host: bool  # the k devices are processes sharing this host's cores
    note: str

    def __post_init__(self) -> None:
        if self.alpha_s is not None and not (math.isfinite(self.alpha_s) and self.alpha_s >= 0):
            raise ValueError(f"alpha must be a finite latency >= 0 s, got {self.alpha_s}")
        if self.beta_Bps is not None and not (math.isfinite(self.beta_Bps) and self.beta_Bps > 0):
            raise ValueError(f"beta must be a finite bandwidth > 0 bytes/s, got {self.beta_Bps}")
        eta = self.overlap_efficiency
        if eta is not None and not 0.0 <= eta <= 1.0:
            raise ValueError(f"overlap efficiency must be between 0 and 1, got {eta}")

    @property
    def measured(self) -> bool:
        """True when some of α, β, η still have to be measured on this machine."""
        return None in (self.alpha_s, self.beta_Bps, self.overlap_efficiency)


_GB = 1e9
INTERCONNECTS: dict[str, Interconnect] = {
    "loopback": Interconnect(name="loopback", alpha_s=None, beta_Bps=None, overlap_efficiency=None,
                             shares_host=True, note="k processes on this machine, gloo over 127.0.0.1 (measured)"),
    "pcie": Interconnect(name="pcie", alpha_s=10e-6, beta_Bps=20 * _GB, overlap_efficiency=1.0,
                         shares_host=False, note="PCIe 4.0 x16 peer-to-peer (planning figure)"),
    "nvlink": Interconnect(name="nvlink", alpha_s=5e-6, beta_Bps=150 * _GB, overlap_efficiency=1.0,
                           shares_host=False, note="NVLink 3 class GPUs (planning figure)"),
    "25gbe": Interconnect(name="25gbe", alpha_s=25e-6, beta_Bps=2.8 * _GB, overlap_efficiency=1.0,
                          shares_host=False, note="25 Gb Ethernet, TCP (planning figure)"),
    "100gbe": Interconnect(name="100gbe", alpha_s=10e-6, beta_Bps=11 * _GB, overlap_efficiency=1.0,
                           shares_host=False, note="100 Gb Ethernet, RoCE class (planning figure)"),
}


# A message across a host's link under gloo: its per-message floor over TCP (0.1-0.3 ms on this
# machine's loopback, costmodel.py), the low end, since a message between hosts pays no more for it.
HOST_ALPHA_S = 100e-6


def host_link(link_gbit: float, *, alpha_us: float | None = None, overlap_efficiency: float | None = None,
              simulated: bool = False) -> Interconnect:
    """Each host's link of `link_gbit` Gbit/s (predict/hosts.py): β its rate in bytes/s, α gloo's
    per-message cost unless given, η 1 unless given (the link, not the cores, bounds the exchange)."""
    if not (math.isfinite(link_gbit) and link_gbit > 0):
        raise ValueError(f"--link-gbit {link_gbit} must be a positive number of Gbit/s")
    return Interconnect(name=f"{link_gbit:g} Gbit/s host links", alpha_s=HOST_ALPHA_S if alpha_us is None else alpha_us * 1e-6,
                        beta_Bps=link_gbit * 1e9 / 8, overlap_efficiency=1.0 if overlap_efficiency is None
                        else overlap_efficiency, shares_host=simulated,
                        note="hosts simulated on this machine" if simulated else "hosts like this machine")


def resolve_interconnect(name: str, *, alpha_us: float | None = None, beta_gbps: float | None = None,
                         overlap_efficiency: float | None = None) -> Interconnect:
    """The preset `name` with any of α (µs), β (GB/s, 1e9 bytes/s), η replaced by the caller's."""
    if name not in INTERCONNECTS:
        raise ValueError(f"unknown interconnect {name!r}; choose one of {', '.join(INTERCONNECTS)}")
    preset = INTERCONNECTS[name]
    return Interconnect(
        name=name, shares_host=preset.shares_host, note=preset.note,
        alpha_s=preset.alpha_s if alpha_us is None else alpha_us * 1e-6,
        beta_Bps=preset.beta_Bps if beta_gbps is None else beta_gbps * _GB,
        overlap_efficiency=preset.overlap_efficiency if overlap_efficiency is None else overlap_efficiency)


@dataclass(frozen=True, kw_only=True)
class PredictConfig:
    model: str = "lenet"
    global_batch_sizes: tuple[int, ...] = (256,)
    world_sizes: tuple[int, ...] = (1, 2, 4, 8)
    algorithm: str = "auto"  # auto: what training would pick (shm on loopback, native on a real link)
    bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB  # None: one bucket
    interconnect: Interconnect = INTERCONNECTS["loopback"]
    validate: bool = False  # also measure phalanx at each k (loopback only) and report the error
    rounds: int = 1  # predict (and validate) this many times, interleaved
    warmup_steps: int = 2
    steps: int = 8  # timed steps per profile phase and per validation run
    lr: float = 0.2
    seed: int = 0
    timeout_s: float = 120.0  # bound on one collective
    deadline_s: float = 600.0  # bound on one spawned run
    # --hosts: predict H hosts of workers_per_host over links of link_gbit (predict/hosts.py); the
    # world sizes are then H x workers_per_host, and validation runs on simulated hosts.
    hosts: tuple[int, ...] = ()
    workers_per_host: int = 2
    link_gbit: float | None = None

    def __post_init__(self) -> None:
        if self.model not in BENCH_MODELS:
            raise ValueError(f"unknown model {self.model!r}; choose one of {', '.join(BENCH_MODELS)}")
        if self.hosts:
            self._check_hosts()
        check_choice(self.algorithm)
        if self.algorithm == "auto":  # as training's auto: shm for processes sharing this host
            local = self.interconnect.shares_host and shm_supported() is None
            object.__setattr__(self, "algorithm", "shm" if local else "native")
        if self.algorithm == "shm" and not self.interconnect.shares_host:
            raise ValueError(f"the shm allreduce serves processes on one host; the {self.interconnect.name} "
                             "interconnect links separate devices: use --allreduce native")
        if not self.world_sizes or min(self.world_sizes) < 1 or len(set(self.world_sizes)) != len(self.world_sizes):
            raise ValueError(f"world sizes must be distinct integers >= 1, got {list(self.world_sizes)}")
        if max(self.world_sizes) > 1024:
            raise ValueError(f"world sizes up to 1024 are modelled, got {max(self.world_sizes)}")
        small = [b for b in self.global_batch_sizes if b < max(self.world_sizes)]
        if not self.global_batch_sizes or small:
            raise ValueError(f"every global batch size must be >= the largest world size {max(self.world_sizes)} "
                             f"(one example per device), got {list(self.global_batch_sizes)}")
        if self.bucket_cap_mb is not None and not (math.isfinite(self.bucket_cap_mb) and self.bucket_cap_mb > 0):
            raise ValueError(f"bucket cap must be a positive number of MB (or none), got {self.bucket_cap_mb}")
        for name, low in (("rounds", 1), ("steps", 2), ("warmup_steps", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be at least {low}, got {getattr(self, name)}")
        if self.validate and not self.interconnect.shares_host and not self.hosts:
            raise ValueError(f"validation measures this machine over loopback, not {self.interconnect.name}; "
                             "drop --validate or use --interconnect loopback")

    def _check_hosts(self) -> None:
        if min(self.hosts) < 2 or len(set(self.hosts)) != len(self.hosts):
            raise ValueError(f"--hosts {','.join(map(str, self.hosts))} must list distinct host counts of at least 2")
        if self.workers_per_host < 1:
            raise ValueError(f"--workers-per-host {self.workers_per_host} must be at least 1")
        if self.link_gbit is None:
            raise ValueError("--hosts needs --link-gbit, the speed of each host's link (e.g. --link-gbit 10)")
        object.__setattr__(self, "world_sizes", tuple(h * self.workers_per_host for h in self.hosts))

    @property
    def world_sizes_sorted(self) -> tuple[int, ...]:
        return tuple(sorted(self.world_sizes))
