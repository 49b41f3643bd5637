"""A cgroup CPU quota caps the usable cores (cgroup v2 cpu.max, v1 cpu.cfs_quota_us), read from
fake cgroup trees: the threads per worker, --devices auto's layouts and the first line all follow
the one count, `binding.available_cores`."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.job import auto_devices
from phalanx.runtime import binding, topology


def v2_tree(root: Path, cpu_max: str, *, cgroup: str = "/") -> Path:
    """A cgroup v2 mount with our cgroup at `cgroup` holding `cpu_max`; the /proc/self/cgroup file."""
    directory = root.joinpath(*[part for part in cgroup.split("/") if part])
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cpu.max").write_text(cpu_max + "\n")
    (root / "self_cgroup").write_text(f"0::{cgroup}\n")
    return root / "self_cgroup"


def v1_tree(root: Path, quota_us: int, period_us: int = 100000, *, cgroup: str = "/tE") -> Path:
    """A cgroup v1 cpu,cpuacct mount (reached through its `cpu` link) with our cgroup's quota."""
    directory = root.joinpath("cpu,cpuacct", *[part for part in cgroup.split("/") if part])
    directory.mkdir(parents=True)
    (root / "cpu").symlink_to("cpu,cpuacct")
    (directory / "cpu.cfs_quota_us").write_text(f"{quota_us}\n")
    (directory / "cpu.cfs_period_us").write_text(f"{period_us}\n")
    (root / "self_cgroup").write_text(f"4:memory:/\n2:cpu,cpuacct:{cgroup}\n1:name=systemd:/\n")
    return root / "self_cgroup"


def test_cgroup_v2_quota_is_read_from_cpu_max(tmp_path):
    self_cgroup = v2_tree(tmp_path, "50000 100000")
    assert topology.cpu_quota(tmp_path, self_cgroup) == 0.5
    assert topology.quota_cores(0.5) == 1 and topology.quota_cores(1.5) == 2 and topology.quota_cores(2.0) == 2


def test_cgroup_v2_max_means_no_quota(tmp_path):
    assert topology.cpu_quota(tmp_path, v2_tree(tmp_path, "max 100000")) is None
    assert topology.quota_cores(None) is None


def test_cgroup_v1_quota_is_quota_over_period(tmp_path):
    assert topology.cpu_quota(tmp_path, v1_tree(tmp_path, 150000)) == 1.5


def test_cgroup_v1_minus_one_means_no_quota(tmp_path):
    assert topology.cpu_quota(tmp_path, v1_tree(tmp_path, -1)) is None


def test_the_tightest_quota_on_the_path_wins_and_missing_host_paths_walk_up(tmp_path):
    self_cgroup = v2_tree(tmp_path, "300000 100000", cgroup="/a/b")
    (tmp_path / "a" / "cpu.max").write_text("100000 100000\n")  # the parent allows less
    assert topology.cpu_quota(tmp_path, self_cgroup) == 1.0
    # A container sees the host's path in /proc/self/cgroup but only its own cgroup at the mount.
    inside = tmp_path / "inside"
    inside.mkdir()
    (inside / "cpu.max").write_text("50000 100000\n")
    (inside / "self_cgroup").write_text("0::/docker/0123abcd\n")
    assert topology.cpu_quota(inside, inside / "self_cgroup") == 0.5


def test_no_cgroup_files_means_no_quota(tmp_path):
    assert topology.cpu_quota(tmp_path, tmp_path / "absent") is None


@pytest.fixture
def half_a_cpu_on_two_cores(tmp_path, monkeypatch):
    """This process: affinity to 2 CPUs (each its own core), a cgroup v2 quota of 0.5 CPU."""
    monkeypatch.setattr(binding.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(topology, "topology", lambda cpu, field: cpu if field == "core_id" else 0)
    self_cgroup = v2_tree(tmp_path, "50000 100000")
    monkeypatch.setattr(topology, "CGROUP_ROOT", tmp_path, raising=False)
    monkeypatch.setattr(topology, "SELF_CGROUP", self_cgroup, raising=False)


def test_a_half_cpu_quota_gives_one_thread_and_one_layout(half_a_cpu_on_two_cores):
    assert binding.available_cores() == 1
    assert binding.worker_threads(1, bind_cores=False, threads=None) == 1  # was 2: 2.2x slower
    assert binding.worker_threads(1, bind_cores=True, threads=None) == 1
    assert binding.worker_threads(1, bind_cores=False, threads=3) == 3  # --threads-per-device wins
    layouts = auto_devices.candidate_layouts(256, cores=binding.available_cores(), threads=None, bind_cores=False)
    assert layouts == [auto_devices.Layout(workers=1, threads=1)]


def test_the_first_line_names_the_quota_that_limits(half_a_cpu_on_two_cores, monkeypatch):
    assert binding.quota_note() == " (a cgroup CPU quota of 0.5 CPU leaves 1 of 2 cores)"
    assert "quota of 0.5 CPU" in binding.too_many_workers(2)
    monkeypatch.setattr(topology, "CGROUP_ROOT", topology.CGROUP_ROOT / "elsewhere")
    assert binding.quota_note() == "" and binding.available_cores() == 2  # no quota: nothing said
