"""The host's limits a run meets: a temporary directory, file descriptors, threads, address space
and /dev/shm, each refused or explained in one line that names the limit and the fix.

Found by an outside container trial, each was a traceback: a read-only /tmp (`docker
--read-only`) ended in 47 lines from tempfile (torch's own import of its compiler cache needs a
temporary directory too, so there is no going on without one); `ulimit -n 12..14` in c10d's
retries of the store for two minutes, then ~300 lines; `ulimit -u 8..12` in a gloo "Resource
temporarily unavailable"; `ulimit -v 1000000` in an ImportError ("failed to map segment") or a
MemoryError; a DataLoader worker on an 8 MiB /dev/shm in "Caught RuntimeError in DataLoader
worker process 0", its cause 30 lines below. `check_temp_dir` and `check_limits` refuse before
anything starts; `limit_reason` turns a worker's error that a limit explains into its one line.
"""

from __future__ import annotations

import errno
import os
import resource
import tempfile

from phalanx.errors import UsageError

# What a run of k spawned workers needs at least, measured on 2026-12-03 (cpu:k, synthetic data,
# LeNet): descriptors: k=2 runs at 30 and fails at 28, k=4 runs at 36 and fails at 32 (below, the
# store's clients fail with EMFILE and retry for two minutes); processes and threads: k=2 runs at
# 16 and fails at 12 (the trial, as nobody; root is exempt); address space per process: 1.5e6 KiB runs, 1e6 KiB
# fails in the workers' imports. Each floor leaves room for a data set's files and loader pipes.
# (resource, its ulimit flag, the floor for k workers in ulimit's unit, what it counts)
_FLOORS = (
    (resource.RLIMIT_NOFILE, "-n", lambda k: 32 + 4 * k, "open files"),
    (resource.RLIMIT_NPROC, "-u", lambda k: 8 + 4 * k, "processes and threads of this user"),
    (resource.RLIMIT_AS, "-v", lambda k: 1_500_000, "KiB of address space per process"),
)
# The value each fix names: the usual default, or what the run needs where that is more.
_FIX = {"-n": lambda need: f"ulimit -n {max(need, 1024)}", "-u": lambda need: f"ulimit -u {max(need, 4096)}",
        "-v": lambda need: "ulimit -v unlimited"}


def check_temp_dir() -> None:
    """Refuse in one line a host with no writable temporary directory (tempfile tries TMPDIR,
    /tmp, /var/tmp, /usr/tmp and the working directory)."""
    try:
        tempfile.gettempdir()
    except OSError:  # "No usable temporary directory found in [...]" (FileNotFoundError)
        raise UsageError("no writable temporary directory (TMPDIR, /tmp, /var/tmp and the working directory are "
                         "read-only, full or missing), and torch and the workers need one; set TMPDIR to a "
                         "writable directory (TMPDIR=$HOME/tmp, or a tmpfs mount under docker --read-only) "
                         "and run again") from None


def check_limits(num_workers: int) -> None:
    """Raise a soft limit below what `num_workers` spawned workers need up to the hard limit (the
    workers inherit it); refuse in one line, naming the limit and the fix, where the hard limit
    itself is too low."""
    for which, flag, floor, unit in _FLOORS:
        if which == resource.RLIMIT_NPROC and os.geteuid() == 0:
            continue  # Linux does not hold root to it
        scale = 1024 if flag == "-v" else 1  # ulimit -v counts KiB, getrlimit bytes
        need = floor(num_workers) * scale
        soft, hard = resource.getrlimit(which)
        if soft == resource.RLIM_INFINITY or soft >= need:
            continue
        if hard == resource.RLIM_INFINITY or hard >= need:
            # Descriptors to 1024, the usual soft default (a process that closes every possible
            # descriptor pays for a huge one); the others to the hard limit.
            target = hard if which != resource.RLIMIT_NOFILE else max(need, 1024)
            target = target if hard == resource.RLIM_INFINITY else min(target, hard)
            resource.setrlimit(which, (target, hard))
            continue
        fewer = ", or run fewer workers" if floor(1) != floor(2) else ""  # a floor that grows with k
        raise UsageError(f"ulimit {flag} is {soft // scale} (hard limit {hard // scale}), and {num_workers} "
                         f"worker(s) need at least {need // scale} {unit}; raise it ({_FIX[flag](need // scale)}: "
                         f"the hard limit too, as root or with docker run --ulimit) and run again{fewer}")


def _limited(which: int) -> int | None:
    soft, _ = resource.getrlimit(which)
    return None if soft == resource.RLIM_INFINITY else soft


def limit_reason(exc: BaseException) -> str | None:
    """One line for an error that a finite limit of this process explains (descriptors, threads,
    address space), naming the limit and the fix; None for any other error."""
    text = f"{type(exc).__name__}: {exc}"
    if (getattr(exc, "errno", None) == errno.EMFILE or "Too many open files" in text) \
            and _limited(resource.RLIMIT_NOFILE) is not None:
        soft = _limited(resource.RLIMIT_NOFILE)
        return (f"too many open files ({text.splitlines()[0][:160]}): this process may hold {soft} (ulimit -n); "
                f"raise it ({_FIX['-n'](2 * soft)}) and run again")
    threads = _limited(resource.RLIMIT_NPROC)
    if threads is not None and not isinstance(exc, BlockingIOError) and (
            "Resource temporarily unavailable" in text or "can't start new thread" in text
            or getattr(exc, "errno", None) == errno.EAGAIN) and _user_tasks() >= 0.9 * threads:
        return (f"a worker could not start a thread ({text.splitlines()[0][:160]}): this user may run only "
                f"{threads} processes and threads (ulimit -u {threads}), and each worker starts several (torch's "
                "intra-op pool, gloo, the store); raise it (ulimit -u 4096), or run fewer workers or "
                "--threads-per-device 1")
    if any(words in text for words in _SHM_FULL):
        return f"a DataLoader worker could not pass a batch through shared memory: {_shm_size()}"
    space = _limited(resource.RLIMIT_AS)
    if space is not None and (isinstance(exc, MemoryError) or "failed to map segment" in text
                              or "Cannot allocate memory" in text or "bad_alloc" in text):
        return (f"out of address space ({text.splitlines()[0][:160]}): each process may map only "
                f"{space / 2**30:.2f} GiB (ulimit -v {space // 1024}), and torch and its libraries map more "
                "than 1 GiB per worker (2 GiB ran LeNet in the trial); raise it (ulimit -v unlimited) and run again")
    return None


def _user_tasks() -> int:
    """The processes and threads this user runs (what `ulimit -u` counts), as far as /proc shows:
    a finite limit explains an EAGAIN only near it (non-root users have one, ~60,000, by default)."""
    uid, count = str(os.getuid()), 0
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as handle:
                fields = dict(line.split(":", 1) for line in handle if ":" in line)
        except OSError:  # gone meanwhile
            continue
        if fields.get("Uid", "").split()[:1] == [uid]:
            count += int(fields.get("Threads", "1").strip() or 1)
    return count


# What torch says when a DataLoader worker's batch does not fit in /dev/shm: the collate's
# shared storage (ENOSPC), or the worker's SIGBUS on touching a page the tmpfs cannot back.
_SHM_FULL = ("unable to allocate shared memory", "out of shared memory")


def _shm_size(path: str = "/dev/shm") -> str:
    """/dev/shm's size and room, and the fix: the rest of a shared-memory failure's line."""
    fix = "give it more (docker run --shm-size=2g, or a larger tmpfs) or load in the worker itself (num_workers=0)"
    try:
        stat = os.statvfs(path)
    except OSError:
        return f"there is no {path} (batches from num_workers > 0 pass through it); {fix}"
    total, free = stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize
    return (f"{path} holds {total / 2**20:.0f} MiB ({free / 2**20:.0f} MiB free now; docker's default is 64 MiB) and "
            f"every batch in flight from num_workers > 0 passes through it; {fix}")
