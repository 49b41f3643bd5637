"""What else the machine was doing while we measured: the host's busy CPU time and our own.

On a shared machine a timing is only comparable with the load it met. `host_busy_s` reads the
seconds every CPU of the host has spent busy since boot (Linux /proc/stat: user nice system irq
softirq steal; guest time is already inside user); `busy_window` notes, around a block, its wall
time, this process's CPU time and the host's busy time, as a picklable dict a worker returns;
`others_busy_cores` turns the windows of a set of workers into the cores other programs kept busy
meanwhile, and `cpu_taken_by_others` does the same for a block in this process (its reaped
children and the fork server's workers included: `own_cpu_s`). Off Linux the host's time is None
and nothing is subtracted.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator, Sequence

from phalanx.runtime.fork_server import server_pid
from phalanx.runtime.procs import process_cpu_s


# Cores other programs kept busy past which a timing says it was taken under that load (the
# scaling table, autopar's verdicts): each contender then lost a different share of the cores.
DISTURBED_CORES = 0.25


def _host_cpu_s() -> list[float] | None:
    """/proc/stat's CPU seconds since boot, all CPUs: user nice system idle iowait irq softirq steal
    (guest is in user); None off Linux."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:9]]
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None  # not Linux
    return [v / ticks for v in fields]


def _busy_s(seconds: list[float]) -> float:
    """The busy part of `_host_cpu_s`: all but idle and iowait."""
    return sum(seconds) - seconds[3] - (seconds[4] if len(seconds) > 4 else 0)


def host_busy_s() -> float | None:
    """CPU seconds the whole host has spent busy since boot (Linux /proc/stat), or None."""
    seconds = _host_cpu_s()
    return None if seconds is None else _busy_s(seconds)


@contextlib.contextmanager
def busy_window() -> Iterator[dict[str, float | None]]:
    """Fill the yielded dict with the block's `wall_s`, this process's `cpu_s` (every thread) and
    the host's `host_busy_s` over it (None off Linux). The clock is read innermost, so reading
    /proc/stat costs the wall time nothing."""
    window: dict[str, float | None] = {}
    host0, cpu0 = host_busy_s(), time.process_time()
    start_s = time.perf_counter()
    try:
        yield window
    finally:
        window["wall_s"] = time.perf_counter() - start_s
        window["cpu_s"] = time.process_time() - cpu0
        host1 = host_busy_s()
        window["host_busy_s"] = None if host0 is None or host1 is None else host1 - host0


def others_busy_cores(windows: Sequence[dict]) -> float:
    """Cores other programs kept busy during the workers' common window: the host's busy time (from
    the first window) minus every worker's own CPU time, per wall second; 0.0 off Linux."""
    host = windows[0]["host_busy_s"]
    if host is None:
        return 0.0
    ours = sum(w["cpu_s"] for w in windows)
    return max(0.0, (host - ours) / max(windows[0]["wall_s"], 1e-9))


def own_cpu_s() -> float:
    """CPU seconds of this process, its reaped children, and the fork server with the workers it
    forked and reaped (runtime/fork_server.py): those are the server's children, not ours, so
    os.times() alone never counts phalanx's workers while the server lives. A server restarted in
    between is counted right by differences: the old one, reaped by us, moves into our children's."""
    own = os.times()
    return own.user + own.system + own.children_user + own.children_system + process_cpu_s(server_pid())


def _machine_and_own_cpu_s() -> tuple[float, float, float] | None:
    """(CPU seconds the host has spent busy, of which a virtual machine's hypervisor gave its CPUs to
    other guests - /proc/stat's steal, 0 on bare metal -, `own_cpu_s`), from one read; None off Linux."""
    seconds = _host_cpu_s()
    if seconds is None:
        return None
    return _busy_s(seconds), (seconds[7] if len(seconds) > 7 else 0.0), own_cpu_s()


@contextlib.contextmanager
def cpu_taken_by_others(result: dict[str, float | None]) -> Iterator[None]:
    """Fill result["others_cores"]: how many cores other processes kept busy, on average, while the
    block ran. On a shared machine that is what a contender could not have (None off Linux). And
    result["stolen_cores"]: how many of those a virtual machine's hypervisor gave to other guests
    (steal; on a VM the busiest neighbours are often not this host's processes at all)."""
    before, start_s = _machine_and_own_cpu_s(), time.perf_counter()
    try:
        yield
    finally:
        after, wall_s = _machine_and_own_cpu_s(), time.perf_counter() - start_s
        result["others_cores"] = result["stolen_cores"] = None
        if before is not None and after is not None and wall_s > 0:
            result["others_cores"] = max(0.0, ((after[0] - before[0]) - (after[2] - before[2])) / wall_s)
            result["stolen_cores"] = max(0.0, (after[1] - before[1]) / wall_s)
