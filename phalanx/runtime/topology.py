"""The host's CPUs as placement needs them: which logical CPUs this process may use, grouped into
physical cores (SMT siblings together), from /sys/devices/system/cpu/cpuN/topology.

Two logical CPUs of one physical core (hyperthreads) share its execution units: a worker that
gets one sibling while another worker gets the other competes with it for every multiply. So
placement hands out whole physical cores, and a core's siblings count as one core in
`physical_cores`. Where /sys says nothing (not Linux, a container that hides it) every logical
CPU is its own core.
"""

from __future__ import annotations

import os

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
