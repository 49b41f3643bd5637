"""The host's CPUs as placement needs them: which logical CPUs this process may use, grouped into
physical cores (SMT siblings together), from /sys/devices/system/cpu/cpuN/topology; and how many
CPUs' worth of time its cgroup's CPU quota grants (`cpu_quota`).

Two logical CPUs of one physical core (hyperthreads) share its execution units: a worker that
gets one sibling while another worker gets the other competes with it for every multiply. So
placement hands out whole physical cores, and a core's siblings count as one core in
`physical_cores`. Where /sys says nothing (not Linux, a container that hides it) every logical
CPU is its own core.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

_TOPOLOGY = "/sys/devices/system/cpu/cpu{}/topology/{}"


def topology(cpu: int, field: str) -> int:
    """One field of a CPU's topology (physical_package_id, die_id, core_id); unknown: every CPU
    its own core on package 0."""
    try:
        with open(_TOPOLOGY.format(cpu, field)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return cpu if field == "core_id" else 0


def physical_cores(cpus: list[int]) -> list[list[int]]:
    """`cpus` grouped by physical core, ordered by (package, die, core id); siblings in CPU order."""
    cores: dict[tuple[int, int, int], list[int]] = {}
    for cpu in sorted(cpus):
        key = (topology(cpu, "physical_package_id"), topology(cpu, "die_id"), topology(cpu, "core_id"))
        cores.setdefault(key, []).append(cpu)
    return [cores[key] for key in sorted(cores)]


def allowed_cpus() -> list[int]:
    """The logical CPUs this process may run on (its affinity mask, so a container's or taskset's
    limit counts), siblings of one physical core next to each other."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: no affinity API
        return list(range(os.cpu_count() or 1))
    return [cpu for core in physical_cores(cpus) for cpu in core]


# Where the cgroup hierarchy is mounted and which cgroup this process is in; module constants so a
# test can point them at fake files.
CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")


def _cgroup_dirs(root: Path, self_cgroup: Path) -> list[Path]:
    """The directories that may hold a CPU limit for this process: its cgroup and every ancestor,
    under the v2 mount (`root`) and the v1 cpu controller's (`root`/cpu, `root`/cpu,cpuacct).
    A container mounts only its own cgroup there, so a path the host names that does not exist
    inside is walked up until one does (the container's own, at the mount's top)."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    found: dict[Path, str] = {}  # a mount of the v2 hierarchy or v1's cpu controller -> our cgroup's path
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            found[root] = path
        elif "cpu" in controllers.split(","):
            found[root / "cpu"] = path
            found[root / controllers] = path
    if not found:  # nothing known: the mounts' tops (a container's own cgroup)
        found = {root: "/", root / "cpu": "/", root / "cpu,cpuacct": "/"}
    dirs: list[Path] = []
    for base, path in found.items():
        parts = [part for part in path.split("/") if part]
        dirs.extend(base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1))
    return dirs


def _limit_in(directory: Path) -> float | None:
    """The CPUs' worth of time per period `directory`'s own quota allows (v2 cpu.max "50000 100000",
    v1 cpu.cfs_quota_us / cpu.cfs_period_us), None where it sets none ("max", -1, no file)."""
    try:
        if (directory / "cpu.max").is_file():
            quota, period = (directory / "cpu.max").read_text().split()[:2]
        else:
            quota = (directory / "cpu.cfs_quota_us").read_text().strip()
            period = (directory / "cpu.cfs_period_us").read_text().strip()
        quota_us, period_us = int(quota), int(period)
    except (OSError, ValueError):  # no such controller here, "max", or unreadable
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def cpu_quota(root: Path | None = None, self_cgroup: Path | None = None) -> float | None:
    """CPUs' worth of time this process's cgroup may use (0.5 for `docker --cpus 0.5`): the tightest
    quota on its cgroup's path, cgroup v2 or v1; None without one. `root`: the cgroup mount
    (default CGROUP_ROOT), `self_cgroup`: the /proc/self/cgroup to read (default SELF_CGROUP).

    A quota leaves the affinity mask alone - a container limited to half a CPU still sees every
    core - but the kernel stops its threads once they used quota per period: 2 threads on 0.5 CPU
    each run a quarter of the time, and an epoch took 2.2x as long as with one thread."""
    root = CGROUP_ROOT if root is None else Path(root)
    self_cgroup = SELF_CGROUP if self_cgroup is None else Path(self_cgroup)
    limits = [limit for limit in map(_limit_in, _cgroup_dirs(root, self_cgroup)) if limit is not None]
    return min(limits, default=None)


def quota_cores(quota: float | None) -> int | None:
    """The whole cores a quota of `quota` CPUs keeps busy (0.5 -> 1, 1.5 -> 2); None: no quota."""
    return None if quota is None else max(1, math.ceil(quota - 1e-9))
