"""Fixtures for the distributed tests alone: `smoke_sized_cores`, for the benchmark smoke tests.

The benchmarks size themselves from the cores they may use (threads per process, the "torch N
threads" contenders, autopar's lanes); a smoke test must not grow with the machine (on 16 cores
the scaling smoke would take 95 s). A module opts in with
`pytestmark = pytest.mark.usefixtures("smoke_sized_cores")`; a test that checks the sizing asks
for the fixture by name and gets the core count it was held to.
"""

import os

import pytest

SMOKE_CORES = 2  # the CI machine's


@pytest.fixture
def smoke_sized_cores() -> int:
    """Pin this thread, and so every thread and process it starts, to at most SMOKE_CORES of the
    cores it may use for the test, then restore; the value is SMOKE_CORES."""
    if not hasattr(os, "sched_setaffinity"):
        yield SMOKE_CORES
        return
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, sorted(allowed)[:SMOKE_CORES])
    try:
        yield SMOKE_CORES
    finally:
        os.sched_setaffinity(0, allowed)
