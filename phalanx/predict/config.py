"""What `phalanx predict` is asked: the run to plan (`PredictConfig`, every field that is a flag
declared on it) and the link between devices (`Interconnect`, with presets for planning; its
flags are `LinkOptions`, which resolve to one).

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

from phalanx.comm import CHOICES
from phalanx.comm.shm import shm_supported
from phalanx.data_parallel.config import bucket_cap_for, bucket_cap_mb_option
from phalanx.measure.mlp import BENCH_MODELS
from phalanx.options import Rule, at_least, check_options, component, finite, option, positive


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
    return Interconnect(name=f"{link_gbit:g} Gbit/s host links",
                        alpha_s=HOST_ALPHA_S if alpha_us is None else alpha_us * 1e-6, beta_Bps=link_gbit * 1e9 / 8,
                        overlap_efficiency=1.0 if overlap_efficiency is None else overlap_efficiency,
                        shares_host=simulated,
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
class LinkOptions:
    """the link: an interconnect's preset, any of its numbers replaced"""

    interconnect: str = option("loopback", choices=tuple(INTERCONNECTS),
                               help="the link between devices (loopback: measured on this machine)")
    alpha_us: float | None = option(None, default_text="the preset's", help="link latency per message in microseconds",
                                    check=finite(at_least(0, problem="must be a finite latency of 0 µs or more")))
    beta_gbps: float | None = option(None, default_text="the preset's", help="link bandwidth in GB/s (1e9 bytes/s)",
                                     check=finite(positive("finite bandwidth in GB/s")))
    overlap_efficiency: float | None = option(None, default_text="the preset's",
                                              help="share 0..1 of overlapped communication that really hides",
                                              check=Rule(ok=lambda share: 0 <= share <= 1,
                                                         problem="must be between 0 and 1"))

    def __post_init__(self) -> None:
        check_options(self)

    def resolve(self) -> Interconnect:
        return resolve_interconnect(self.interconnect, alpha_us=self.alpha_us, beta_gbps=self.beta_gbps,
                                    overlap_efficiency=self.overlap_efficiency)


@dataclass(frozen=True, kw_only=True)
class PredictConfig:
    """what to predict: the model, the batches, the device counts, the exchange and the link"""

    model: str = option("lenet", choices=BENCH_MODELS, help="the model profiled")
    global_batch_sizes: tuple[int, ...] = option((256,), flag="--batch-size", items=int, help="global batch sizes")
    world_sizes: tuple[int, ...] = option((1, 2, 4, 8), items=int, check=at_least(1), help="device counts k to predict")
    # auto: what training would pick (shm on loopback, native on a real link)
    algorithm: str = option("auto", flag="--allreduce", choices=CHOICES,
                            help="the allreduce (auto: shm on loopback, native on the other links)")
    overlap: bool | None = option(None, default_text="auto, as phalanx train's", help="predict (and validate) the "
                                  "exchange beside backward (--overlap) or after it (--no-overlap)")
    bucket_cap_mb: float | str | None = bucket_cap_mb_option()  # auto: resolved below, as training's
    interconnect: Interconnect = component(LinkOptions, into=LinkOptions.resolve)
    # also measure phalanx at each k (loopback only) and report the error
    validate: bool = option(False, help="measure phalanx at each k here (loopback, k <= 2 x cores) and print the error")
    rounds: int = option(1, check=at_least(1), help="repeat profile, link and validation")
    warmup_steps: int = option(2, check=at_least(0), help="untimed steps first")
    steps: int = option(8, check=at_least(2), help="timed steps per profile setting and measurement")
    lr: float = 0.2
    seed: int = 0
    timeout_s: float = 120.0  # bound on one collective
    deadline_s: float = 600.0  # bound on one spawned run
    out_dir: str = option("runs/predict", flag="--out", metavar="DIR", help="directory for predict.json and predict.png")
    # --hosts: predict H hosts of workers_per_host over links of link_gbit (predict/hosts.py); the
    # world sizes are then H x workers_per_host, and validation runs on simulated hosts.
    hosts: tuple[int, ...] | None = option(None, items=int, check=at_least(2), default_text="none",
                                    help="host counts H: predict H hosts of --workers-per-host workers over links of "
                                    "--link-gbit, flat gloo against the hierarchical allreduce")
    workers_per_host: int = option(2, check=at_least(1), help="with --hosts: workers per host")
    link_gbit: float | None = option(None, default_text="none", check=finite(positive("number of Gbit/s")),
                                     help="with --hosts: each host's link, each way, in Gbit/s")

    def __post_init__(self) -> None:
        check_options(self)
        if self.hosts or self.link_gbit is not None:
            self._for_hosts()
        if self.algorithm == "auto":  # as training's auto: shm for processes sharing this host
            local = self.interconnect.shares_host and shm_supported() is None
            object.__setattr__(self, "algorithm", "shm" if local else "native")
        # auto: the cap training gives the allreduce predicted (--hosts: hierarchical's; both rows share buckets)
        cap = bucket_cap_for(self.bucket_cap_mb, algorithm="hierarchical" if self.hosts else self.algorithm)
        object.__setattr__(self, "bucket_cap_mb", cap)
        if self.algorithm == "shm" and not self.interconnect.shares_host:
            raise ValueError(f"the shm allreduce serves processes on one host; the {self.interconnect.name} "
                             "interconnect links separate devices: use --allreduce native")
        if len(set(self.world_sizes)) != len(self.world_sizes):
            raise ValueError(f"--world-sizes {_csv(self.world_sizes)} names a count twice; name each once")
        if max(self.world_sizes) > 1024:
            raise ValueError(f"--world-sizes {_csv(self.world_sizes)}: world sizes up to 1024 are modelled")
        small = [b for b in self.global_batch_sizes if b < max(self.world_sizes)]
        if small:
            raise ValueError(f"--batch-size {_csv(self.global_batch_sizes)}: every global batch size must be at least "
                             f"the largest world size {max(self.world_sizes)} (one example per device)")
        if self.validate and not self.interconnect.shares_host and not self.hosts:
            raise ValueError(f"validation measures this machine over loopback, not {self.interconnect.name}; "
                             "drop --validate or use --interconnect loopback")

    def _for_hosts(self) -> None:
        """The world sizes and the link of --hosts: H x workers_per_host, each host's link."""
        if not self.hosts:
            raise ValueError(f"--link-gbit {self.link_gbit:g} is the link between hosts: give --hosts too")
        if len(set(self.hosts)) != len(self.hosts):
            raise ValueError(f"--hosts {_csv(self.hosts)} names a count twice; name each once")
        if self.link_gbit is None:
            raise ValueError("--hosts needs --link-gbit, the speed of each host's link (e.g. --link-gbit 10)")
        if self.overlap is not None:
            flag = "--overlap" if self.overlap else "--no-overlap"
            raise ValueError(f"--hosts predicts flat against hierarchical exchanges as training runs them (beside "
                             f"backward); drop {flag}")
        link = self.interconnect
        if link.name != "loopback" or link.beta_Bps is not None:
            raise ValueError(f"--hosts takes each host's link from --link-gbit; drop --interconnect {link.name} "
                             "and --beta-gbps")
        object.__setattr__(self, "world_sizes", tuple(h * self.workers_per_host for h in self.hosts))
        object.__setattr__(self, "interconnect", host_link(
            self.link_gbit, alpha_us=None if link.alpha_s is None else link.alpha_s * 1e6,
            overlap_efficiency=link.overlap_efficiency, simulated=self.validate))

    @property
    def world_sizes_sorted(self) -> tuple[int, ...]:
        return tuple(sorted(self.world_sizes))


def _csv(values) -> str:
    return ",".join(map(str, values))
