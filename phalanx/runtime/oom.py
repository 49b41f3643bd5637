"""Whether a worker's SIGKILL was the kernel's out-of-memory killer, from what can be read cheaply.

A worker killed by SIGKILL was reported as "died (signal SIGKILL)" and nothing more, though under
a container's memory limit (`docker --memory`, a cgroup) or on a full host that is almost always
the OOM killer, and the fix is memory: fewer workers, a smaller batch. dmesg says so but is
seldom readable in a container; the memory cgroup's own counter is: cgroup v2's `memory.events`
and v1's `memory.oom_control` both hold an `oom_kill` count of the processes the OOM killer
ended in that cgroup (and below it). The launcher reads it as the workers start and again when
one dies of SIGKILL: a count that rose names the OOM killer, one that did not says so, and an
unreadable one leaves the most common cause as the likely one.
"""

from __future__ import annotations

CGROUP_ROOT = "/sys/fs/cgroup"


def _counter_files(cgroup_root: str, proc_cgroup: str) -> list[str]:
    """Where this process's memory cgroup keeps its oom_kill count, most specific first; the
    hierarchy's top as a fallback (a container sees its own cgroup there, whatever
    /proc/self/cgroup names)."""
    files = []
    try:
        with open(proc_cgroup) as handle:
            lines = handle.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2: "0::/path"
            files.append(f"{cgroup_root}{path.rstrip('/')}/memory.events")
        elif "memory" in controllers.split(","):  # v1: "4:memory:/path"
            files.append(f"{cgroup_root}/memory{path.rstrip('/')}/memory.oom_control")
    return files + [f"{cgroup_root}/memory.events", f"{cgroup_root}/memory/memory.oom_control"]


def oom_kill_count(*, cgroup_root: str = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> int | None:
    """The OOM killer's count of kills in this process's memory cgroup, or None where it cannot be read."""
    for path in _counter_files(cgroup_root, proc_cgroup):
        try:
            with open(path) as handle:
                for line in handle:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


_FIX = "use fewer workers (--devices) or a smaller batch, or give the run more memory (docker --memory)"


def sigkill_cause(before: int | None, now: int | None) -> str:
    """What a worker's SIGKILL most likely was, given the OOM-kill count as the workers started
    (`before`) and after the death (`now`); None for either: unreadable."""
    if before is not None and now is not None and now > before:
        return (f"the kernel's out-of-memory killer ended it (this memory cgroup's oom_kill count went from "
                f"{before} to {now}): the workers need more memory than the host or container allows, so {_FIX}")
    if before is not None and now is not None:
        return (f"not the kernel's out-of-memory killer as far as this memory cgroup counts (oom_kill stayed at "
                f"{now}): something else sent SIGKILL (kill -9, a scheduler's hard stop)")
    return ("most often the kernel's out-of-memory killer (dmesg would say, and this host's cgroup oom_kill count "
            f"cannot be read): if so, {_FIX}")
