"""What a bench counts as its own CPU time includes phalanx's workers: they are the fork server's
children, not the launcher's, and a bench that missed them called its own workers' load the
host's (8.3 of 16 cores "busy elsewhere" on the 16-core host, 2026-12-04)."""

from __future__ import annotations

import sys
import time

import pytest

from phalanx.measure.load import cpu_taken_by_others, own_cpu_s
from phalanx.runtime.devices import parse_devices
from phalanx.runtime.launch import LaunchSpec, launch

pytestmark = pytest.mark.distributed
BURN_S = 1.0


def burn(world) -> float:
    """BURN_S of this worker's CPU time; what it measured."""
    start = time.process_time()
    while time.process_time() - start < BURN_S:
        sum(range(1000))
    return time.process_time() - start


@pytest.mark.skipif(sys.platform != "linux", reason="CPU accounting reads Linux /proc")
def test_own_cpu_time_includes_the_workers_the_fork_server_started():
    spec = LaunchSpec(plan=parse_devices("cpu:2", cuda_count=0), threads_per_device=1, timeout_s=30.0,
                      deadline_s=60.0)
    load: dict[str, float | None] = {}
    before = own_cpu_s()
    with cpu_taken_by_others(load):
        burned = launch(burn, spec=spec)
    ours = own_cpu_s() - before
    assert sum(burned) >= 2 * BURN_S
    assert ours >= sum(burned) - 0.05, f"{ours:.2f} s counted as ours of the workers' {sum(burned):.2f} s"
    # CPU time, not wall time: whatever else the machine does, the workers' 2 s are ours, so they
    # cannot show up as others' (which, on a quiet machine, read as 2 cores over a 1 s run).
    assert load["others_cores"] is not None and load["others_cores"] >= 0
