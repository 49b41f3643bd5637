"""--bind-cores' split of a host's cores: equal, disjoint, hyperthread siblings together,
leftovers unused, a one-line refusal when workers outnumber cores; the one warning line when
workers x threads exceed the cores, and `phalanx run`'s first line naming each worker's threads;
and a user's allocator setting winning over phalanx's (tests/distributed/test_launch.py checks, in
fresh interpreters, what that setting does for the workers phalanx does not spawn itself)."""

from __future__ import annotations

import os

import pytest

from phalanx.runtime import binding, topology
from phalanx.errors import UsageError


@pytest.fixture(autouse=True)
def no_cgroup_quota(tmp_path, monkeypatch):
    """The fake hosts below are the affinity mask alone: the build machine's own cgroup quota, if
    any, stays out (tests/unit/test_cpu_quota.py covers quotas)."""
    monkeypatch.setattr(topology, "CGROUP_ROOT", tmp_path / "no-cgroup")


def test_slices_are_equal_disjoint_and_in_rank_order():
    cores = list(range(16))
    slices = [binding.cores_for(r, 4, cores) for r in range(4)]
    assert slices == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]


def test_leftover_cores_stay_unused_so_every_worker_gets_the_same_share():
    slices = [binding.cores_for(r, 3, list(range(8))) for r in range(3)]
    assert [len(s) for s in slices] == [2, 2, 2]
    assert len({c for s in slices for c in s}) == 6


def test_hyperthread_siblings_land_in_one_slice(monkeypatch):
    # Linux numbers 8 cores x 2 threads as cpu0-7 then their siblings cpu8-15 (core_id = cpu % 8).
    monkeypatch.setattr(binding.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(topology, "topology", lambda cpu, field: cpu % 8 if field == "core_id" else 0)
    order = binding.allowed_cores()
    assert order[:4] == [0, 8, 1, 9]
    assert binding.cores_for(1, 4, order) == [2, 10, 3, 11]
    assert binding.describe([2, 10, 3, 11]) == "2,10,3,11" and binding.describe([4, 5, 6]) == "4-6"


def test_shares_are_whole_physical_cores_while_every_worker_can_have_one(monkeypatch):
    monkeypatch.setattr(binding.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(topology, "topology", lambda cpu, field: cpu % 8 if field == "core_id" else 0)
    # 3 workers on 8 cores x 2: two whole cores each (a split by logical CPUs, 5 each, cut a core in two).
    assert [binding.cores_for(r, 3) for r in range(3)] == [[0, 8, 1, 9], [2, 10, 3, 11], [4, 12, 5, 13]]
    # More workers than physical cores: the siblings are dealt out, neighbours on one core.
    assert [binding.cores_for(r, 16) for r in range(3)] == [[0], [8], [1]]
    assert binding.worker_threads(3, bind_cores=True, threads=None) == 4
    assert binding.worker_threads(3, bind_cores=False, threads=None) == 5  # 16 // 3 logical CPUs


def test_the_placement_default_is_one_place_to_change(monkeypatch):
    monkeypatch.setattr(binding.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(topology, "topology", lambda cpu, field: cpu % 8 if field == "core_id" else 0)
    assert binding.PLACEMENT == binding.Placement(threads_on_siblings=True, core_for_comm=False)
    assert binding.worker_threads(2, bind_cores=True, threads=None) == 8
    monkeypatch.setattr(binding, "PLACEMENT", binding.Placement(threads_on_siblings=False, core_for_comm=True))
    assert binding.worker_threads(2, bind_cores=True, threads=None) == 3  # 4 physical cores, one left to comm
    assert binding.worker_threads(2, bind_cores=False, threads=None) == 3
    assert binding.worker_threads(1, bind_cores=False, threads=None) == 8  # one worker: nothing to leave
    assert binding.worker_threads(16, bind_cores=False, threads=None) == 1  # never below one
    assert binding.worker_threads(2, bind_cores=True, threads=5) == 5  # --threads-per-device wins


def test_affinity_mask_is_respected(monkeypatch):
    monkeypatch.setattr(binding.os, "sched_getaffinity", lambda pid: {2, 3, 6, 7}, raising=False)
    monkeypatch.setattr(topology, "topology", lambda cpu, field: cpu if field == "core_id" else 0)
    assert [binding.cores_for(r, 2) for r in range(2)] == [[2, 3], [6, 7]]


def test_more_workers_than_cores_is_refused_in_one_line():
    with pytest.raises(UsageError, match=r"--bind-cores needs a core per worker: 3 workers on this host, 2 cores "
                                         r"available; use at most 2 devices or drop --bind-cores"):
        binding.cores_for(0, 3, [0, 1])
    with pytest.raises(ValueError, match="local_rank 2 must be in"):
        binding.cores_for(2, 2, [0, 1])


def _warned(monkeypatch, capsys, cores: int, devices: str, threads: int | None = None, bind: bool = False) -> list:
    from phalanx.runtime.devices import parse_devices
    from phalanx.runtime.launch import LaunchSpec, warn_if_oversubscribed

    monkeypatch.setattr(binding.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    spec = LaunchSpec(plan=parse_devices(devices, cuda_count=0), threads_per_device=threads, bind_cores=bind)
    warn_if_oversubscribed(spec, local_workers=spec.plan.num_devices)
    return capsys.readouterr().err.splitlines()


def test_workers_times_threads_above_the_cores_is_one_warning_line(monkeypatch, capsys):
    # Warned whether or not --threads-per-device is given: --devices cpu:16 on 2 cores runs 10x slower.
    assert _warned(monkeypatch, capsys, 2, "cpu:16") == [
        "phalanx: warning: 16 CPU workers on this host, 1 thread each, on 2 cores: they take turns and training "
        "can be many times slower; use at most 2 CPU devices here"]
    assert _warned(monkeypatch, capsys, 2, "cpu:2") == []  # 1 thread each: fits
    assert _warned(monkeypatch, capsys, 8, "cpu:3") == []  # 2 threads each (8 // 3): fits
    assert _warned(monkeypatch, capsys, 2, "cpu:2", bind=True) == []  # a core each
    assert _warned(monkeypatch, capsys, 2, "cpu:1", threads=4)[0].startswith(
        "phalanx: warning: --threads-per-device 4 x 1 local worker(s) = 4 threads on 2 cores")
    assert len(_warned(monkeypatch, capsys, 2, "cpu:3", threads=1)) == 1
    assert binding.worker_threads(3, bind_cores=False, threads=None) == 1  # 2 cores // 3, at least 1


def test_phalanx_runs_first_line_names_workers_threads_and_rendezvous(monkeypatch):
    from phalanx.runtime.devices import parse_devices
    from phalanx.runtime.launch import LaunchSpec
    from phalanx.runtime.script import first_line

    monkeypatch.setattr(binding.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    cpu = LaunchSpec(plan=parse_devices("cpu:3", cuda_count=0))
    assert first_line(cpu, workers=3, local_workers=3, store="127.0.0.1:4000", launcher="phalanx") == (
        "phalanx run: 3 workers on cpu, 2 threads each; rendezvous env:// through phalanx's store at 127.0.0.1:4000")
    assert first_line(cpu, workers=4, local_workers=2, store="node0:29500", launcher="torchrun") == (
        "phalanx run: 4 workers on cpu (2 on this host), 4 threads each; rendezvous env:// through torchrun's "
        "store at node0:29500")
    gpus = LaunchSpec(plan=parse_devices("cuda:0,1", cuda_count=2))
    assert first_line(gpus, workers=2, local_workers=2, store="127.0.0.1:4000", launcher="phalanx").startswith(
        "phalanx run: 2 workers on cuda:0, cuda:1, torch's default threads; ")


def test_a_users_malloc_variable_wins_over_phalanxs_allocator_setting(monkeypatch):
    for key in [key for key in os.environ if key.startswith("MALLOC_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.rtld.nns=2")  # not the allocator's
    assert binding.users_allocator_setting() is None
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=131072")
    assert binding.users_allocator_setting() == "GLIBC_TUNABLES"
    monkeypatch.setenv("MALLOC_PERTURB_", "0")  # glibc's own default value: glibc's allocator as it comes
    assert binding.users_allocator_setting() == "MALLOC_PERTURB_"
    assert binding.keep_freed_memory_mapped() is False  # nothing changed in this process


@pytest.mark.parametrize("cores, workers, threads, bound, free", [
    (2, 2, 1, False, False),  # the 2-core machine: 2 workers x 1 thread fill it
    (16, 8, 2, False, False),  # 16 cores, 8 workers x 2 threads: full
    (16, 8, 1, False, True),  # a core left per worker (Placement.core_for_comm)
    (12, 8, 1, False, False),  # 4 cores left for 8 communication threads: not one each
    (16, 2, 7, False, True),
    (16, 2, 8, False, False),
    (2, 1, 2, True, False),  # --bind-cores: its own 2 cores, 2 threads
    (3, 1, 2, True, True),
])
def test_a_core_is_left_for_the_communication_thread_only_beside_the_training_threads(monkeypatch, cores, workers,
                                                                                      threads, bound, free):
    monkeypatch.setattr(binding, "available_cores", lambda: cores)
    monkeypatch.setattr(binding.torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(binding, "_bound", bound)
    assert binding.workers_sharing_cores(workers) == (1 if bound else workers)
    sharing = binding.workers_sharing_cores(workers)
    assert binding.leaves_core_for_comm(cores=binding.available_cores(), workers=sharing,
                                        threads=binding.torch.get_num_threads()) is free
