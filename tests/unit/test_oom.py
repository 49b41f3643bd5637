"""A worker SIGKILL ended is reported with what it most likely was: the kernel's OOM killer when
the memory cgroup's oom_kill count rose (cgroup v2 memory.events, v1 memory.oom_control), not it
when the count stayed, the likely cause when the count cannot be read. It was "died (signal
SIGKILL)" alone, with no word of memory."""

from phalanx.runtime import worker_errors
from phalanx.runtime.oom import oom_kill_count, sigkill_cause


def _proc_cgroup(tmp_path, text):
    path = tmp_path / "cgroup"
    path.write_text(text)
    return str(path)


def test_the_count_is_read_from_a_v2_cgroup(tmp_path):
    (tmp_path / "sys" / "box").mkdir(parents=True)
    (tmp_path / "sys" / "box" / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\n")
    assert oom_kill_count(cgroup_root=str(tmp_path / "sys"), proc_cgroup=_proc_cgroup(tmp_path, "0::/box\n")) == 2


def test_the_count_is_read_from_a_v1_cgroup_or_the_top_of_the_hierarchy(tmp_path):
    (tmp_path / "sys" / "memory" / "tE").mkdir(parents=True)
    (tmp_path / "sys" / "memory" / "tE" / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    root = str(tmp_path / "sys")
    assert oom_kill_count(cgroup_root=root, proc_cgroup=_proc_cgroup(tmp_path, "4:memory:/tE\n0::/\n")) == 3
    # a container sees its own cgroup at the top, whatever /proc/self/cgroup names
    (tmp_path / "sys" / "memory" / "memory.oom_control").write_text("oom_kill 5\n")
    assert oom_kill_count(cgroup_root=root, proc_cgroup=_proc_cgroup(tmp_path, "4:memory:/elsewhere\n")) == 5
    assert oom_kill_count(cgroup_root=str(tmp_path / "none"), proc_cgroup=str(tmp_path / "missing")) is None


def test_what_a_sigkill_was():
    assert sigkill_cause(1, 2).startswith("the kernel's out-of-memory killer ended it (this memory cgroup's "
                                          "oom_kill count went from 1 to 2)")
    assert "fewer workers" in sigkill_cause(1, 2) and "smaller batch" in sigkill_cause(1, 2)
    assert sigkill_cause(0, 0).startswith("not the kernel's out-of-memory killer")
    assert sigkill_cause(None, None).startswith("most often the kernel's out-of-memory killer")
    # a restart line reads "...; restart 1 of N": no cause may hold a ';' of its own
    assert all(";" not in sigkill_cause(*counts) for counts in ((1, 2), (0, 0), (None, None)))


def test_the_failure_line_says_what_the_kill_was():
    reports = {0: worker_errors.error_report("PeerGone: rank 1 died", "", True),
               1: worker_errors.error_report("died (signal SIGKILL)")}
    message = str(worker_errors.failure(reports, 1, [5, 7], explain_kill=lambda: sigkill_cause(0, 1)))
    assert message.startswith("worker rank 1 failed: died (signal SIGKILL) after step 7: the kernel's "
                              "out-of-memory killer ended it"), message
    other = {0: worker_errors.error_report("ValueError: x", "Traceback ...")}
    assert "out-of-memory" not in str(worker_errors.failure(other, 0, None, explain_kill=lambda: sigkill_cause(0, 1)))
