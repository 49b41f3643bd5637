"""`--devices auto`'s choice on a CPU host, without probing: which layouts are candidates on a
host of so many cores, how the measured ones are judged, and the line that reports them (the
probe itself trains, so it is tested with the distributed tests)."""

from __future__ import annotations

import pytest

from phalanx.errors import UsageError
from phalanx.job.auto_devices import Layout, Probe, candidate_layouts, choose, describe
from phalanx.runtime import binding, topology
from phalanx.runtime.devices import parse_devices


@pytest.fixture
def host(monkeypatch):
    """A host of `cores` logical CPUs, each its own physical core."""
    def of(cores: int) -> None:
        monkeypatch.setattr(binding.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
        monkeypatch.setattr(topology, "topology", lambda cpu, field: cpu if field == "core_id" else 0)
    return of


def test_on_two_cores_the_layouts_are_one_worker_of_two_threads_and_two_of_one(host):
    host(2)
    assert candidate_layouts(256, cores=2, threads=None, bind_cores=False) == [Layout(workers=1, threads=2),
                                                                              Layout(workers=2, threads=1)]


def test_on_sixteen_cores_powers_of_two_share_the_cores(host):
    host(16)
    layouts = candidate_layouts(256, cores=16, threads=None, bind_cores=False)
    assert [(l.workers, l.threads) for l in layouts] == [(1, 16), (2, 8), (4, 4), (8, 2), (16, 1)]
    assert [l.workers for l in candidate_layouts(256, cores=12, threads=None, bind_cores=False)] == [1, 2, 4, 8, 12]
    # Each must fit the global batch and the split; --threads-per-device fixes t.
    assert [l.workers for l in candidate_layouts(3, cores=16, threads=None, bind_cores=False)] == [1, 2]
    assert [l.workers for l in candidate_layouts(256, cores=16, threads=None, bind_cores=False,
                                                 fits=lambda k: k <= 4)] == [1, 2, 4]
    assert {l.threads for l in candidate_layouts(256, cores=16, threads=3, bind_cores=False)} == {3}


def test_the_fastest_wins_and_a_near_tie_goes_to_fewer_workers():
    one, two, four = Layout(workers=1, threads=4), Layout(workers=2, threads=2), Layout(workers=4, threads=1)
    assert choose([Probe(layout=one, images_per_s=3400), Probe(layout=two, images_per_s=3700)]) == two
    assert choose([Probe(layout=one, images_per_s=3650), Probe(layout=two, images_per_s=3700),
                   Probe(layout=four, images_per_s=3690)]) == one  # within 3% of the fastest


def test_the_first_line_names_the_choice_and_every_measured_layout_in_order():
    one, two = Layout(workers=1, threads=2), Layout(workers=2, threads=1)
    probes = [Probe(layout=one, images_per_s=3403.4), Probe(layout=two, images_per_s=3700.2)]
    assert describe(two, probes, probe_s=0.84) == (
        "--devices auto: cpu:2 x 1 thread (measured images/s over 0.8 s: cpu:1 x 2 threads 3403, "
        "cpu:2 x 1 thread 3700; the fastest, or the fewest workers within 3% of it)")
    assert "not probed (past 8 s): cpu:2 x 1 thread;" in describe(one, probes[:1], probe_s=9.0, skipped=(two,))


def test_auto_is_every_gpu_and_on_a_cpu_host_train_only():
    assert parse_devices("auto", cuda_count=2).names == ("cuda:0", "cuda:1")
    with pytest.raises(UsageError, match="--devices auto on a CPU host is phalanx train's .*give --devices cpu:N"):
        parse_devices("auto", cuda_count=0)
    for gpus in (0, 1):  # the probe's CPU workers, GPUs present or not: train's alone too
        with pytest.raises(UsageError, match="--devices cpu:auto is phalanx train's .*give --devices cpu:N"):
            parse_devices("cpu:auto", cuda_count=gpus)
