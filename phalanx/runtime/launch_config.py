"""The launch options `phalanx train` and `phalanx run` share: which devices, threads, core binding, timeout.

`LaunchConfig` holds them as typed (each a flag, declared once here: phalanx/options.py); `spec`
turns them, with the device plan --devices resolved to on this host, into the launcher's
`LaunchSpec`. The device text itself is checked where the host's devices are known
(runtime/devices.py's `parse_devices`).
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.options import at_least, check_options, option, wait_seconds
from phalanx.runtime.devices import DevicePlan
from phalanx.runtime.launch import LaunchSpec

DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """launch: the devices, and how each worker runs"""

    devices: str = option("1", help="N, cpu:N, cuda:0,1, auto or cpu:auto (N: GPUs when present, else CPU "
                                    "workers; auto: every GPU, or for train on a CPU host the workers x threads "
                                    "a probe of the model finds fastest; cpu:auto: that probe's on any host)")
    threads_per_device: int | None = option(None, help="CPU threads per worker", check=at_least(1),
                                            default_text="the cores / the workers on this host")
    bind_cores: bool = option(False, help="pin each local worker to its own equal share of the cores "
                                          "(threads = its share)")
    timeout_s: float = option(DEFAULT_TIMEOUT_S, flag="--timeout", metavar="SECONDS",
                              help="how long any collective may wait before the run fails",
                              check=wait_seconds())

    def __post_init__(self) -> None:
        check_options(self)

    def spec(self, plan: DevicePlan) -> LaunchSpec:
        """The launcher's spec for these options on `plan` (--devices, resolved on this host)."""
        return LaunchSpec(plan=plan, threads_per_device=self.threads_per_device, timeout_s=self.timeout_s,
                          bind_cores=self.bind_cores)
